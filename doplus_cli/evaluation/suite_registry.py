"""The suites of `doplus evaluate`, by name in the order `--suite` lists them: what the runner runs, and what the
attacks and the bench read each suite's facts from (`Suite`: its files, judges, forget-side metrics). A module of
its own, so that the attacks, which the runner imports, can read the suites without importing the runner."""

from __future__ import annotations

from doplus_cli.evaluation.lm_eval_suite import LM_EVAL_SUITE
from doplus_cli.evaluation.muse import MUSE_SUITE
from doplus_cli.evaluation.safety import SAFETY_SUITE, XSTEST_SUITE
from doplus_cli.evaluation.suite_api import Suite
from doplus_cli.evaluation.suites import PRIVACY_SUITE, REAL_WORLD_SUITE, TOFU_SUITE
from doplus_cli.evaluation.wmdp import WMDP_SUITE
from doplus_cli.registry import Registry

SUITE_REGISTRY: Registry[Suite] = Registry("suite", Suite, ((suite.name, suite) for suite in (
    TOFU_SUITE, REAL_WORLD_SUITE, LM_EVAL_SUITE, PRIVACY_SUITE, SAFETY_SUITE, XSTEST_SUITE, WMDP_SUITE, MUSE_SUITE)))
SUITES = tuple(SUITE_REGISTRY)
