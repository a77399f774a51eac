"""``Engine(compile="aot", prepack_weights=True)``: the packages of a model whose linear weights are prepacked
(``blocks.prepacked_linear``) call ``zoo::prepacked_linear`` with each layer's handle, a constant the engine hands
over like any buffer. The compile process prepacks the same layers of the model it rebuilds (their names are in the
spec). Checked: every package runs and passes its first-step check; the tokens and step logits of a staggered run
equal the eager engine's on the plain model and each request's ``generate`` alone; the packages take the handles and
no prepacked weight; their key is not the plain model's.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from blocks import prepacked_linear
from blocks.prepacked_linear import PrepackedLinear
from serving import Engine
from serving.aot_export import KINDS
from serving.aot_steps import package_key

from .test_engine import alone, run_staggered
from .test_engine_aot import LENGTHS, LIMITS, arrivals, assert_same_outputs, thin_model

#: Slow (its packages take about 45 s of one worker to compile): ``tests/serving/test_engine_prepack.py`` checks the
#: compile process's side up to AOTInductor in the fast suite.
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One staggered run on a prepacked engine whose packages were compiled in its child process, one on an eager
    engine over the plain model."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ZOO_AOT_CACHE", str(tmp_path_factory.mktemp("aot-prepacked")))
        patch.setattr(prepacked_linear, "MIN_ELEMENTS", 0)  # the thin model's weights are all small
        plain = thin_model()
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n, _ in LENGTHS]
        model = copy.deepcopy(plain)
        engine = Engine(model, compile="aot", prepack_weights=True, **LIMITS)
        assert engine.runner.aot.wait(600), engine.runner.aot.failed
        outputs = run_staggered(engine, arrivals(prompts))
        eager = run_staggered(Engine(copy.deepcopy(plain), compile=False, **LIMITS), arrivals(prompts))
        yield dict(plain=plain, model=model, prompts=prompts, engine=engine, outputs=outputs, eager=eager)


def test_every_package_runs_and_gives_the_plain_models_outputs(run: dict[str, Any]) -> None:
    runner = run["engine"].runner
    assert set(runner.aot.steps) == set(KINDS) and runner.aot.failed is None
    assert runner.aot.process is not None and runner.aot.process.returncode == 0
    for step in runner.aot.steps.values():
        assert step.calls > 0 and step.checked
    assert_same_outputs(run["outputs"], run["eager"])
    for (n, max_tokens), prompt, out in zip(LENGTHS, run["prompts"], _by_prompt(run), strict=True):
        assert out.token_ids == alone(run["plain"], prompt, max_tokens), n


def _by_prompt(run: dict[str, Any]) -> list:
    """The outputs in the order of ``LENGTHS`` (they are in order of arrival)."""
    from .test_engine_aot import ARRIVALS

    order = [i for step in sorted(ARRIVALS) for i in ARRIVALS[step]]
    return [out for _, out in sorted(zip(order, run["outputs"], strict=True), key=lambda pair: pair[0])]


def test_the_packages_take_the_handles_and_no_prepacked_weight(run: dict[str, Any]) -> None:
    model = run["model"]
    layers = [name for name, m in model.named_modules() if isinstance(m, PrepackedLinear)]
    assert len(layers) == 7 * model.config.n_layers  # q, k, v, o, gate, up, down (the head is tied)
    for step in run["engine"].runner.aot.steps.values():
        constants = {fqn.removeprefix("model.") for fqn in step.loader.get_constant_fqns()}
        assert {f"{name}.handle" for name in layers} <= constants
        assert not any(name.endswith("_proj.weight") for name in constants)


def test_the_key_is_not_the_plain_models(run: dict[str, Any]) -> None:
    args = (LIMITS["block_size"], torch.float32)
    assert package_key(run["model"], *args) != package_key(run["plain"], *args)
