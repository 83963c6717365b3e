"""All built-in quantities and the base classes to write your own."""

from cockpit_like.quantities import bin_adaptation
from cockpit_like.quantities.activations import ActivationStats
from cockpit_like.quantities.alpha import Alpha
from cockpit_like.quantities.data_stats import DataStats
from cockpit_like.quantities.byproducts import GradNorm, Loss, Parameters, Time
from cockpit_like.quantities.gradient_noise import CABS, EarlyStopping, MeanGSNR
from cockpit_like.quantities.gradient_tests import InnerTest, NormTest, OrthoTest
from cockpit_like.quantities.histograms import GradHist1d, GradHist2d
from cockpit_like.quantities.curvature import HessTrace, TICDiag, TICTrace
from cockpit_like.quantities.hess_max_ev import HessMaxEV
from cockpit_like.quantities.hessian_spectrum import HessEigenvalues, HessSpectralDensity, HessTraceEstimate
from cockpit_like.quantities.kfac_trace import KFACTrace
from cockpit_like.quantities.learning_rate import BatchSize, LearningRate, Momentum
from cockpit_like.quantities.curvature_statistics import (
    CurvatureStatistics,
    EKFACSpectrum,
    PreconditionedGradNorm,
    SelfInfluence,
)
from cockpit_like.quantities.parameter_motion import Distance, UpdateSize
from cockpit_like.quantities.parameter_norm import ParamNorm
from cockpit_like.quantities.quantity import (
    ByproductQuantity,
    Quantity,
    SingleStepQuantity,
    TwoStepQuantity,
)

__all__ = [
    "Quantity",
    "SingleStepQuantity",
    "TwoStepQuantity",
    "ByproductQuantity",
    "Loss",
    "Time",
    "Parameters",
    "GradNorm",
    "Distance",
    "UpdateSize",
    "Alpha",
    "CABS",
    "EarlyStopping",
    "MeanGSNR",
    "NormTest",
    "InnerTest",
    "OrthoTest",
    "GradHist1d",
    "GradHist2d",
    "HessTrace",
    "TICDiag",
    "TICTrace",
    "HessMaxEV",
    "HessEigenvalues",
    "HessSpectralDensity",
    "HessTraceEstimate",
    "KFACTrace",
    "CurvatureStatistics",
    "EKFACSpectrum",
    "PreconditionedGradNorm",
    "SelfInfluence",
    "ParamNorm",
    "ActivationStats",
    "DataStats",
    "LearningRate",
    "Momentum",
    "BatchSize",
]
