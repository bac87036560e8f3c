"""Signal maths on 1-D series, shared by the loss-curve analyses.

Pure NumPy / SciPy functions over uniformly sampled arrays (one series, or a stack of
series of one length along the last axis): no store, no
:class:`~gradforensics.analysis.contract.model.Context`, no flags, no plots.  The
analyses in :mod:`gradforensics.analysis.kinds` (``loss_spectrum``, ``fractal``,
``coherence``) import them from their modules, never from each other.

* :mod:`~gradforensics.analysis.toolkit.signal.welch` - the Hann window, Welch's power and
  cross-spectral densities, coherence;
* :mod:`~gradforensics.analysis.toolkit.signal.trend` - the log-time fit, level shifts and
  winsorising around the smoother;
* :mod:`~gradforensics.analysis.toolkit.signal.detrending` - trend removal by linear
  filters of known power gain (:func:`~gradforensics.analysis.toolkit.signal.detrending.detrend_many`,
  :class:`~gradforensics.analysis.toolkit.signal.detrending.Detrended`);
* :mod:`~gradforensics.analysis.toolkit.signal.background` - AR(1) red noise seen through
  the detrender, fitted to many residuals at once, its expected Welch estimate and degrees of freedom;
* :mod:`~gradforensics.analysis.toolkit.signal.peaks` - multiple-testing corrections, local
  maxima, refined frequencies, harmonic grouping;
* :mod:`~gradforensics.analysis.toolkit.signal.spectrum` -
  :func:`~gradforensics.analysis.toolkit.signal.spectrum.line_spectra`: the Welch periodogram tested
  against that background, and :class:`~gradforensics.analysis.toolkit.signal.spectrum.SpectrumOptions`,
  the options the three loss-curve analyses share.
"""

__all__: list[str] = []          # a namespace of modules: import from the defining module
