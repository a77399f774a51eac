"""``adapter_config.json`` applied exactly as ``peft`` applies it, or refused naming the field.

Parity: a tiny ``transformers`` model (exported from a zoo model) gets a ``peft`` LoRA with ``use_rslora``,
``rank_pattern``/``alpha_pattern``, ``layers_to_transform``/``layers_pattern``, a regex ``target_modules`` or
``exclude_modules``; its ``B`` weights are randomised, ``peft`` saves it, the zoo model loads it, the logits agree.
Hostile files: a valid file written by ``peft``'s ``save_pretrained`` with one field corrupted; the error is a
``ValueError`` naming the field, and the model is left as it was.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import re
import shutil
import warnings
from pathlib import Path

import peft
import pytest
import torch
from peft.tuners.tuners_utils import check_target_module_exists
from safetensors.torch import load_file, save_file
from torch import nn

from blocks.adapters import AdaptedLinear
from models import DecoderLM
from models.checkpoints.peft_names import PeftTargets
from tests.models.test_adapters import TINY, gpt2_like, hf_logits, ids, logits, transformers_copy

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("transformers").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # peft: fan_in_fan_out on GPT-2's Conv1D
        yield


def llama_like() -> DecoderLM:
    return DecoderLM.from_preset("llama-tiny", **{**TINY, "n_kv_heads": 1}).eval()


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, tuple[nn.Module, nn.Module]]:
    """For each family, a zoo model and the ``transformers`` model it exports to (exported once per module)."""
    torch.manual_seed(0)
    out = {}
    for family, make in (("gpt2", gpt2_like), ("llama", llama_like)):
        zoo = make()
        out[family] = (zoo, transformers_copy(zoo, tmp_path_factory.mktemp(family)))
    return out


def peft_adapter(hf: nn.Module, folder: Path, **config) -> nn.Module:
    """``peft`` LoRA on a copy of ``hf`` with random ``B`` weights, saved by ``save_pretrained`` into ``folder``."""
    model = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(**config)).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.save_pretrained(folder)
    return model


PARITY = {
    "use_rslora": ("gpt2", dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["c_attn", "c_fc"])),
    "rank_and_alpha_pattern": ("llama", dict(
        r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={r"layers\.0\.self_attn\.q_proj": 3, "v_proj": 5}, alpha_pattern={"down_proj": 7, "v_proj": 1.5},
    )),
    "rslora_with_patterns": ("llama", dict(
        r=2, lora_alpha=4, use_rslora=True, target_modules=["q_proj", "down_proj"], rank_pattern={"down_proj": 6},
    )),
    "layers_to_transform": ("gpt2", dict(r=2, lora_alpha=4, target_modules=["c_attn", "c_proj"],
                                         layers_to_transform=[1])),
    "layers_pattern": ("llama", dict(r=2, lora_alpha=4, target_modules=["q_proj", "up_proj"], layers_to_transform=0,
                                     layers_pattern="layers")),
    "regex_target_modules": ("gpt2", dict(r=3, lora_alpha=5, target_modules=r".*\.h\.1\.(attn\.c_attn|mlp\.c_fc)")),
    "exclude_modules": ("llama", dict(r=2, lora_alpha=4, target_modules=["q_proj", "o_proj"],
                                      exclude_modules=r"model\.layers\.1\..*")),
}


@pytest.mark.parametrize("case", list(PARITY))
def test_peft_adapter_with_the_field_gives_peft_logits(case: str, bases, tmp_path: Path) -> None:
    family, config = PARITY[case]
    zoo, hf = bases[family]
    zoo = copy.deepcopy(zoo)
    theirs_model = peft_adapter(hf, tmp_path / "adapter", **config)
    x = ids()
    theirs, base = hf_logits(theirs_model, x), logits(zoo, x)
    adapted = zoo.load_adapter(tmp_path / "adapter")
    assert adapted
    torch.testing.assert_close(logits(zoo, x), theirs, atol=1e-4, rtol=0)
    assert (theirs - base).abs().max() > 1e-2  # the adapter matters


def test_layers_to_transform_adapts_only_those_layers(bases, tmp_path: Path) -> None:
    zoo, hf = bases["gpt2"]
    peft_adapter(hf, tmp_path / "a", r=2, target_modules=["c_attn", "c_fc"], layers_to_transform=[1])
    adapted = copy.deepcopy(zoo).load_adapter(tmp_path / "a")
    assert adapted and all(name.startswith("layers.1.") for name in adapted)


NAMES = [
    "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj", "model.layers.12.mlp.up_proj",
    "model.layers.1.experts.0.up_proj", "model.layers.0.experts.3.up_proj", "transformer.h.0.attn.c_attn",
    "transformer.h.1.mlp.c_fc", "encoder.block.2.layer.0.SelfAttention.q", "decoder.block.0.layer.1.q",
    "q_proj", "lm_head", "blocks.1.attn.qkv", "vision.blocks.0.attn.qkv", "model.layers.0.q_proj_extra",
    "model.layers.0.mlp.gate_up_proj",
]
SELECTIONS = [
    {"target_modules": ["q_proj", "up_proj", "c_attn", "q", "qkv"]},
    {"target_modules": ["model.layers.0.self_attn.q_proj", "lm_head"]},
    {"target_modules": r".*layers\.(0|12)\..*_proj"},
    {"target_modules": ["q_proj", "up_proj"], "layers_to_transform": [0]},
    {"target_modules": ["q_proj", "up_proj", "c_fc"], "layers_to_transform": 1},
    {"target_modules": ["up_proj", "q", "qkv"], "layers_to_transform": [0, 2], "layers_pattern": "experts"},
    {"target_modules": ["up_proj", "q", "qkv"], "layers_to_transform": [1, 2], "layers_pattern": ["layer", "block"]},
    {"target_modules": ["q", "qkv", "c_attn"], "layers_to_transform": [0], "layers_pattern": "blocks?"},
    {"target_modules": ["q_proj", "up_proj"],
     "exclude_modules": ["model.layers.1.self_attn.q_proj", "experts.0.up_proj"]},
    {"target_modules": ["q_proj", "c_attn", "q"], "exclude_modules": r".*\.(0|1)\..*"},
]


@pytest.mark.parametrize("fields", SELECTIONS, ids=range(len(SELECTIONS)))
def test_selection_is_peft_check_target_module_exists(fields: dict) -> None:
    """Which module names the fields select, against peft's own function on names from several architectures."""
    targets = PeftTargets.from_config(fields, "adapter_config.json")
    config = peft.LoraConfig(**fields)
    found = {n: check_target_module_exists(config, n) for n in NAMES}
    theirs = [n for n, f in found.items() if f and type(f).__name__ != "_ExcludedModule"]  # peft's "excluded" mark
    assert [n for n in NAMES if targets.selects(n)] == theirs
    assert theirs  # the case selects something, and (below) not everything
    assert len(theirs) < len(NAMES)


NARROWED = {  # config fields that select fewer modules than the file holds LoRAs for: layer -> adapted
    "layers_to_transform": ({"layers_to_transform": [0]}, {0: ["attn.c_attn", "mlp.c_fc"]}),
    "layers_pattern": ({"layers_to_transform": 1, "layers_pattern": ["blocks", "h"]}, {1: ["attn.c_attn", "mlp.c_fc"]}),
    "regex_target_modules": ({"target_modules": r"transformer\.h\.1\.attn\.c_.*"}, {1: ["attn.c_attn"]}),
    "list_target_modules": ({"target_modules": ["transformer.h.0.attn.c_attn", "c_fc"]},
                            {0: ["attn.c_attn", "mlp.c_fc"], 1: ["mlp.c_fc"]}),
    "exclude_modules": ({"exclude_modules": ["h.0.mlp.c_fc", "transformer.h.1.attn.c_attn"]},
                        {0: ["attn.c_attn"], 1: ["mlp.c_fc"]}),
}


@pytest.mark.parametrize("case", list(NARROWED))
def test_tensors_the_config_does_not_select_are_refused_by_name(case: str, bases, tmp_path: Path) -> None:
    """The attack: an adapter with LoRAs on every layer whose config selects fewer (peft would silently ignore the
    rest; a file peft writes never holds them), refused naming the modules, the model left unchanged."""
    fields, _ = NARROWED[case]
    zoo, hf = bases["gpt2"]
    peft_adapter(hf, tmp_path / "a", r=2, lora_alpha=4, target_modules=["c_attn", "c_fc"])
    config = json.loads((tmp_path / "a" / CONFIG).read_text())
    (tmp_path / "a" / CONFIG).write_text(json.dumps({**config, **fields}))
    zoo = copy.deepcopy(zoo)
    before = logits(zoo, ids())
    with pytest.raises(ValueError, match=r"do not select \['transformer\.h\.\d\.(attn\.c_attn|mlp\.c_fc)'.*which the "
                                         r"adapter holds LoRA weights for"):
        zoo.load_adapter(tmp_path / "a")
    assert zoo.adapter_names == []
    torch.testing.assert_close(logits(zoo, ids()), before, atol=0, rtol=0)


def test_tensors_for_a_module_no_config_targets_are_refused(bases, tmp_path: Path) -> None:
    """``self_attn.evil``: a LoRA pair for a module the config does not target (and the model does not have)."""
    zoo, hf = bases["gpt2"]
    peft_adapter(hf, tmp_path / "a", r=2, lora_alpha=4, target_modules=["c_attn"])
    tensors = load_file(tmp_path / "a" / "adapter_model.safetensors")
    tensors["base_model.model.transformer.h.0.self_attn.evil.lora_A.weight"] = torch.zeros(2, 8)
    tensors["base_model.model.transformer.h.0.self_attn.evil.lora_B.weight"] = torch.zeros(8, 2)
    save_file(tensors, tmp_path / "a" / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"do not select \['transformer\.h\.0\.self_attn\.evil'\]"):
        copy.deepcopy(zoo).load_adapter(tmp_path / "a")


# ---------------------------------------------------------------------------------------------- hostile files
@pytest.fixture(scope="module")
def valid(bases, tmp_path_factory) -> Path:
    """A valid GPT-2 adapter written by ``peft``: rank 2 on ``c_attn`` and ``c_fc`` of both layers."""
    folder = tmp_path_factory.mktemp("valid") / "adapter"
    peft_adapter(bases["gpt2"][1], folder, r=2, lora_alpha=4, target_modules=["c_attn", "c_fc"])
    return folder


def corrupt(valid: Path, tmp_path: Path, **fields) -> Path:
    """A copy of the valid adapter whose ``adapter_config.json`` has ``fields`` replaced (``None`` writes null)."""
    folder = tmp_path / "adapter"
    shutil.copytree(valid, folder)
    config = json.loads((folder / CONFIG).read_text())
    (folder / CONFIG).write_text(json.dumps({**config, **fields}))
    return folder


def refused(bases, folder: Path, match: str) -> None:
    """Loading ``folder`` raises ``ValueError`` matching ``match`` and leaves the model as it was."""
    model = copy.deepcopy(bases["gpt2"][0])
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        model.load_adapter(folder)
    assert model.adapter_names == [] and not any(isinstance(m, AdaptedLinear) for m in model.modules())
    assert all(p.requires_grad for p in model.parameters())
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], v) for k, v in state.items())


BAD_FIELDS = [
    ({"r": 0}, r"r=0; expected a positive integer"),
    ({"r": "2"}, r"r='2'; expected a positive integer"),
    ({"r": 2.0}, r"r=2\.0; expected a positive integer"),
    ({"r": True}, r"r=True; expected a positive integer"),
    ({"lora_alpha": "16"}, r"lora_alpha='16'; expected a finite number"),
    ({"lora_alpha": None}, r"lora_alpha=None; expected a finite number"),
    ({"lora_alpha": math.inf}, r"lora_alpha=inf; expected a finite number"),
    ({"lora_dropout": 1.5}, r"lora_dropout=1\.5; expected a number in \[0, 1\)"),
    ({"lora_dropout": "0.1"}, r"lora_dropout='0\.1'"),
    ({"use_rslora": "yes"}, r"use_rslora='yes'; expected true or false"),
    ({"init_lora_weights": "pissa"}, r"init_lora_weights='pissa'"),
    ({"rank_pattern": {"c_attn(": 2}}, r"rank_pattern 'c_attn\(', which is not a valid regular expression"),
    ({"rank_pattern": {"c_attn": 0}}, r"rank_pattern\['c_attn'\]=0; expected a positive integer"),
    ({"rank_pattern": {"c_attn": "2"}}, r"rank_pattern\['c_attn'\]='2'; expected a positive integer"),
    ({"rank_pattern": ["c_attn"]}, r"rank_pattern=\['c_attn'\]; expected an object"),
    ({"rank_pattern": {"c_attn": 3}}, r"has rank 2 but adapter_config\.json says rank_pattern\['c_attn'\]=3"),
    ({"r": 3}, r"has rank 2 but adapter_config\.json says r=3"),
    ({"alpha_pattern": {"c_fc": "x"}}, r"alpha_pattern\['c_fc'\]='x'; expected a finite number"),
    ({"alpha_pattern": {"[": 3}}, r"alpha_pattern '\[', which is not a valid regular expression"),
    ({"target_modules": "c_attn("}, r"target_modules 'c_attn\(', which is not a valid regular expression"),
    ({"target_modules": []}, r"target_modules=\[\]; expected a regular expression or a non-empty list"),
    ({"target_modules": None}, r"target_modules=None; expected a regular expression"),
    ({"target_modules": [1]}, r"target_modules=\[1\]; expected"),
    ({"target_modules": "all-linear"}, r"target_modules='all-linear'"),
    ({"target_modules": ["q_proj"]}, r"target_modules=\['q_proj'\].*selects none of the modules"),
    ({"exclude_modules": "*"}, r"exclude_modules '\*', which is not a valid regular expression"),
    ({"exclude_modules": 3}, r"exclude_modules=3; expected null, a regular expression"),
    ({"layers_to_transform": -1}, r"layers_to_transform=\[-1\]; expected null, a layer index"),
    ({"layers_to_transform": ["0"]}, r"layers_to_transform=\['0'\]; expected"),
    ({"layers_to_transform": True}, r"layers_to_transform=True; expected"),
    ({"layers_to_transform": [0], "target_modules": ".*c_attn"}, r"layers_to_transform=\[0\] with a regular exp"),
    ({"layers_to_transform": [0], "layers_pattern": "h("}, r"layers_pattern 'h\(', which is not a valid regular"),
    ({"layers_to_transform": [0], "layers_pattern": 3}, r"layers_pattern=3; expected null, a string"),
    ({"layers_pattern": "h"}, r"layers_pattern='h' without layers_to_transform"),
    ({"modules_to_save": ["lm_head"]}, r"modules_to_save=\['lm_head'\], which transformer-zoo does not implement"),
    ({"use_dora": True}, r"use_dora=True, which transformer-zoo does not implement"),
]


@pytest.mark.parametrize(("fields", "match"), BAD_FIELDS, ids=[str(f) for f, _ in BAD_FIELDS])
def test_a_corrupted_config_field_is_named_and_the_model_is_unchanged(
    fields: dict, match: str, bases, valid: Path, tmp_path: Path
) -> None:
    refused(bases, corrupt(valid, tmp_path, **fields), match)


def test_targeted_modules_without_weights_and_random_init_are_refused(bases, valid: Path, tmp_path: Path) -> None:
    """``init_lora_weights=false`` makes peft give a targeted module without weights a random LoRA."""
    folder = corrupt(valid, tmp_path, target_modules=["c_attn", "c_fc", "c_proj"], init_lora_weights=False)
    refused(bases, folder, r"selects \[.*c_proj.*\], which the adapter holds no weights for.*init_lora_weights=False")
    # With peft's default initialisation (B = 0) those modules are unchanged: the adapter loads.
    (folder / CONFIG).write_text(json.dumps({**json.loads((folder / CONFIG).read_text()), "init_lora_weights": True}))
    assert copy.deepcopy(bases["gpt2"][0]).load_adapter(folder)


def _rewrite_tensor(folder: Path, change) -> str:
    tensors = load_file(folder / WEIGHTS)
    key = sorted(k for k in tensors if k.endswith("lora_B.weight"))[0]
    tensors[key] = change(tensors[key])
    save_file(tensors, folder / WEIGHTS)
    return key


@pytest.mark.parametrize(
    ("change", "match"),
    [(lambda t: (t * 100).to(torch.int32), r"int32 tensor; expected a 2-d floating-point tensor"),
     (lambda t: t[None], r"3-d torch.float32 tensor; expected a 2-d"),
     (lambda t: t.index_fill(0, torch.tensor([0]), math.nan), r"holds NaN or infinite values"),
     (lambda t: t[:, :1].contiguous(), r"has lora_A \(2, 16\) and lora_B \(\d+, 1\)")],
    ids=["int32", "3-d", "nan", "rank"],
)
def test_a_corrupted_tensor_is_named_and_the_model_is_unchanged(
    change, match: str, bases, valid: Path, tmp_path: Path
) -> None:
    folder = corrupt(valid, tmp_path)
    key = _rewrite_tensor(folder, change)
    module = key.removeprefix("base_model.model.").removesuffix(".lora_B.weight")
    refused(bases, folder, rf"{re.escape(module)}.*{match}")  # the message names the tensor or its module
