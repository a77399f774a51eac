"""LoRA adapters over the Hub: ``push_adapter_to_hub`` and ``load_adapter(repo_id)`` against the in-process Hub."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from huggingface_hub import HfApi, ModelCard, hf_hub_download
from huggingface_hub.errors import RepositoryNotFoundError

from models import DecoderLM

from .hub_server import HubServer

VOCAB = 50


def tiny() -> DecoderLM:
    return DecoderLM.from_preset("tiny", vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=32, n_layers=1,
                                 dropout=0.0).eval()


def adapted(model: DecoderLM, seed: int, name: str = "default") -> DecoderLM:
    model.add_adapter(r=2, alpha=4, target_modules=["q_proj", "v_proj", "up_proj"], name=name)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if f"adapters.{name}.lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def logits(model: DecoderLM) -> torch.Tensor:
    ids = torch.randint(4, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids).logits


def test_push_then_load_gives_the_same_adapter(hub: HubServer) -> None:
    base = tiny()
    model = adapted(copy.deepcopy(base), seed=0)
    info = model.push_adapter_to_hub("tester/lora", base_model="tester/base")
    files = set(HfApi().list_repo_files("tester/lora")) - {".gitattributes"}
    assert files == {"adapter_config.json", "adapter_model.safetensors", "README.md"}
    card = ModelCard.load(hf_hub_download("tester/lora", "README.md"))
    assert card.data.library_name == "peft" and card.data.base_model == "tester/base"
    config = json.loads(Path(hf_hub_download("tester/lora", "adapter_config.json")).read_text())
    assert config["target_modules"] == ["c_attn", "c_fc"]  # GPT-2's module names

    base.load_adapter("tester/lora", name="pulled")
    assert torch.equal(logits(base), logits(model))
    # A commit sha is a revision too.
    other = tiny()
    other.load_state_dict(base.state_dict(), strict=False)
    other.load_adapter("tester/lora", revision=info.oid)
    assert torch.equal(logits(other), logits(model))


def test_adapters_on_branches_stay_apart(hub: HubServer) -> None:
    base = tiny()
    first = adapted(copy.deepcopy(base), seed=1)
    second = adapted(copy.deepcopy(base), seed=2)
    first.push_adapter_to_hub("tester/lora-branches")
    second.push_adapter_to_hub("tester/lora-branches", revision="v2")
    base.load_adapter("tester/lora-branches", name="main")
    base.load_adapter("tester/lora-branches", name="v2", revision="v2")
    base.set_adapter("main")
    assert torch.equal(logits(base), logits(first))
    base.set_adapter("v2")
    assert torch.equal(logits(base), logits(second))


def test_bad_adapter_pushes_fail_before_any_request(hub: HubServer) -> None:
    model = tiny()
    with pytest.raises(ValueError, match="no active adapter"):
        model.push_adapter_to_hub("tester/none")
    adapted(model, seed=0)
    with pytest.raises(ValueError, match="Repo id must be"):
        model.push_adapter_to_hub("too/many/slashes")
    with pytest.raises(ValueError, match="no adapter named 'other'"):
        model.push_adapter_to_hub("tester/x", name="other")
    assert hub.requests == []


def test_missing_adapter_repo(hub: HubServer) -> None:
    model = tiny()
    with pytest.raises(RepositoryNotFoundError, match="tester/absent"):
        model.load_adapter("tester/absent")
    assert model.adapter_names == []
