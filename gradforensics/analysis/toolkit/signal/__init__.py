"""Signal maths on 1-D series, shared by the loss-curve analyses.

Pure NumPy / SciPy functions over uniformly sampled arrays: no store, no
:class:`~gradforensics.analysis.contract.model.Context`, no flags, no plots.  The
analyses in :mod:`gradforensics.analysis.kinds` (``loss_spectrum``, ``fractal``,
``coherence``) import them from here, never from each other.

* :mod:`~gradforensics.analysis.toolkit.signal.detrending` - trend removal by linear
  filters of known power gain (:func:`detrend`, :class:`Detrended`), level
  shifts, winsorising;
* :mod:`~gradforensics.analysis.toolkit.signal.background` - AR(1) red noise seen through
  the detrender, and its expected Welch estimate and degrees of freedom;
* :mod:`~gradforensics.analysis.toolkit.signal.spectrum` - :func:`line_spectrum`: the
  Welch periodogram tested against that background, multiple-testing
  corrections, refined and harmonic-grouped peaks; :class:`SpectrumOptions`,
  the options the three loss-curve analyses share;
* :mod:`~gradforensics.analysis.toolkit.signal.peaks` - multiple-testing corrections, refined
  frequencies, harmonic grouping; :mod:`~gradforensics.analysis.toolkit.signal.trend` - the
  log-time fit, level shifts and winsorising around the smoother;
  :mod:`~gradforensics.analysis.toolkit.signal.scaling` - Higuchi and box-counting fits;
* :mod:`~gradforensics.analysis.toolkit.signal.replicas` - the ``scipy.signal`` results used
  (Hann window, Savitzky–Golay coefficients, Welch, csd, coherence, ``fftconvolve``, peaks),
  SciPy's floats bit for bit without importing ``scipy.signal``.
"""

from gradforensics.analysis.toolkit.signal.background import (
    expected_welch,
    filtered_ar1_acov,
    fit_ar1,
    hann,
    lag1,
    welch_dof,
)
from gradforensics.analysis.toolkit.signal.detrending import (
    DETRENDERS,
    DetrendCache,
    Detrended,
    default_nperseg,
    detrend,
    log_time_fit,
    remove_level_shifts,
    winsorize,
)
from gradforensics.analysis.toolkit.signal.spectrum import (
    CORRECTIONS,
    MIN_POINTS,
    LineSpectrum,
    Peak,
    SpectrumOptions,
    adjust_pvalues,
    group_harmonics,
    line_spectrum,
    refine_frequency,
    sinusoid_fit,
)

__all__ = [
    "CORRECTIONS",
    "DETRENDERS",
    "MIN_POINTS",
    "DetrendCache",
    "Detrended",
    "LineSpectrum",
    "Peak",
    "SpectrumOptions",
    "adjust_pvalues",
    "default_nperseg",
    "detrend",
    "expected_welch",
    "filtered_ar1_acov",
    "fit_ar1",
    "group_harmonics",
    "hann",
    "lag1",
    "line_spectrum",
    "log_time_fit",
    "refine_frequency",
    "remove_level_shifts",
    "sinusoid_fit",
    "welch_dof",
    "winsorize",
]
