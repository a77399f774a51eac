"""VisionTransformer: patch embedding, permutation equivariance, transformers parity, persistence, errors."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file
from torch import Tensor, nn

import blocks
import models.auto
from blocks.patch_embedding import ConvPatchEmbedding
from models.convert import from_transformers, save_transformers, to_transformers
from models.vit import VisionTransformer, VisionTransformerConfig, interpolate_position_embeddings
from tests.hub.conftest import hub  # noqa: F401  (the in-process Hub server fixture)
from tests.hub.hub_server import HubServer
from tests.strategies import SEEDS, randn

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vit_digits.py"


def tiny_config(**overrides: Any) -> VisionTransformerConfig:
    fields = dict(image_size=8, patch_size=2, num_channels=3, d_model=16, n_layers=2, n_heads=2, d_ff=32,
                  num_labels=5)
    return VisionTransformerConfig(**{**fields, **overrides})


def explicit_patches(images: Tensor, p: int) -> Tensor:
    """Cut ``(B, C, H, W)`` into row-major patches, each flattened channel-major: ``(B, N, C * p * p)``."""
    b, c, h, w = images.shape
    x = images.reshape(b, c, h // p, p, w // p, p)  # (B, C, R, p, Cols, p)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // p) * (w // p), c * p * p)


# ------------------------------------------------------------------------------------------ patch embedding
@given(
    p=st.integers(1, 4), rows=st.integers(1, 4), cols=st.integers(1, 4), channels=st.integers(1, 3),
    batch=st.integers(1, 2), seed=SEEDS,
)
def test_patch_embedding_equals_unfold_and_project(p: int, rows: int, cols: int, channels: int, batch: int,
                                                   seed: int) -> None:
    embed = ConvPatchEmbedding(d_model=6, patch_size=p, num_channels=channels)
    images = randn((batch, channels, rows * p, cols * p), seed)
    weight = embed.proj.weight.reshape(6, channels * p * p)  # (D, C*p*p), same channel-major order
    expected = explicit_patches(images, p) @ weight.T + embed.proj.bias
    torch.testing.assert_close(embed(images), expected, rtol=1e-5, atol=1e-5)
    assert embed.grid(images) == (rows, cols)


def test_patch_embedding_is_registered_and_checks_its_config() -> None:
    assert blocks.get("patch_embedding", "conv") is ConvPatchEmbedding
    embed = blocks.build("patch_embedding", "conv", d_model=4, patch_size=2, num_channels=1, bias=False)
    assert embed.proj.bias is None
    with pytest.raises(ValueError, match="stride"):
        blocks.build("patch_embedding", "conv", d_model=4, patch_size=2, stride=2)
    with pytest.raises(ValueError, match="patch_size must be a positive integer, got 0"):
        ConvPatchEmbedding(d_model=4, patch_size=0)


@pytest.mark.parametrize(
    ("images", "message"),
    [
        (torch.zeros(3, 8, 8), r"\(B, C, H, W\) tensor, got shape \(3, 8, 8\)"),
        (torch.zeros(1, 1, 3, 8, 8), r"got shape \(1, 1, 3, 8, 8\)"),
        (torch.zeros(1, 1, 8, 8), "1 channels, expected num_channels=3"),
        (torch.zeros(1, 3, 8, 7), "8x7 is not a positive multiple of patch_size=2"),
        (torch.zeros(1, 3, 9, 8), "9x8 is not a positive multiple of patch_size=2"),
        (torch.zeros(1, 3, 8, 8, dtype=torch.uint8), "floating point.*uint8"),
        ([[0.0]], "got <class 'list'>"),
    ],
)
def test_patch_embedding_rejects_bad_images(images: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ConvPatchEmbedding(d_model=4, patch_size=2, num_channels=3)(images)


# ------------------------------------------------------------------------------------------ the model
def test_forward_shapes_loss_hidden_states_and_attentions() -> None:
    model = VisionTransformer(tiny_config()).eval()
    images, labels = torch.randn(3, 3, 8, 8), torch.tensor([0, 4, -100])
    out = model(images, labels, output_hidden_states=True, output_attentions=True)
    assert out.logits.shape == (3, 5)
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(out.logits[:2], labels[:2]))
    assert len(out.hidden_states) == 3 and all(h.shape == (3, 17, 16) for h in out.hidden_states)
    assert len(out.attentions) == 2 and all(a.shape == (3, 2, 17, 17) for a in out.attentions)
    torch.testing.assert_close(out.attentions[0].sum(-1), torch.ones(3, 2, 17))
    plain = model(images)
    assert plain.loss is None and plain.hidden_states is None and plain.attentions is None
    torch.testing.assert_close(plain.logits, out.logits)
    # the class token's final (normalised) state is what the head reads
    torch.testing.assert_close(model.classifier(out.hidden_states[-1][:, 0]), out.logits)


def test_mean_pooling_reads_the_mean_patch_token() -> None:
    model = VisionTransformer(tiny_config(pooling="mean")).eval()
    images = torch.randn(2, 3, 8, 8)
    out = model(images, output_hidden_states=True)
    torch.testing.assert_close(model.classifier(out.hidden_states[-1][:, 1:].mean(1)), out.logits)


@given(perm=st.permutations(list(range(16))), seed=SEEDS)
def test_without_positions_patch_tokens_are_permutation_equivariant(perm: list[int], seed: int) -> None:
    torch.manual_seed(0)
    model = VisionTransformer(tiny_config(positional="none", pooling="mean")).eval()
    images = randn((2, 3, 8, 8), seed)
    # move patch i of the 4x4 grid to slot perm^-1(i): token j of the new image is token perm[j] of the old
    blocks_ = images.reshape(2, 3, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5).reshape(2, 16, 3, 2, 2)
    shuffled = blocks_[:, perm].reshape(2, 4, 4, 3, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(2, 3, 8, 8)
    x, _, _ = model.encode(images)
    y, _, _ = model.encode(shuffled)
    torch.testing.assert_close(y[:, 1:], x[:, 1:][:, perm], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(y[:, 0], x[:, 0], rtol=1e-4, atol=1e-5)  # the class token sees a set
    torch.testing.assert_close(model(shuffled).logits, model(images).logits, rtol=1e-4, atol=1e-5)


def test_learned_positions_break_the_symmetry() -> None:
    model = VisionTransformer(tiny_config(pooling="mean")).eval()
    images = torch.randn(1, 3, 8, 8)
    flipped = images.flip(-1).flip(-2)  # reverses the patch order (and each patch)
    x, _, _ = model.encode(images)
    y, _, _ = model.encode(flipped)
    assert not torch.allclose(model.pool(x), model.pool(y), atol=1e-4)


def test_interpolated_positions() -> None:
    model = VisionTransformer(tiny_config()).eval()
    images = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(model(images, interpolate_pos_encoding=True).logits, model(images).logits)
    out = model(torch.randn(2, 3, 12, 6), interpolate_pos_encoding=True, output_hidden_states=True)
    assert out.logits.shape == (2, 5) and out.hidden_states[0].shape == (2, 1 + 6 * 3, 16)
    # a table that is constant over the grid stays constant; the class row is untouched
    table = torch.cat([torch.full((1, 3), 7.0), torch.ones(16, 3)])
    new = interpolate_position_embeddings(table, (4, 4), (5, 3))
    torch.testing.assert_close(new, torch.cat([torch.full((1, 3), 7.0), torch.ones(15, 3)]))
    with pytest.raises(ValueError, match=r"does not hold 1 \+ 3x3"):
        interpolate_position_embeddings(table, (3, 3), (4, 4))
    # without learned positions there is nothing to interpolate: any multiple of the patch size works
    free = VisionTransformer(tiny_config(positional="none")).eval()
    assert free(torch.randn(1, 3, 10, 4)).logits.shape == (1, 5)


@torch.no_grad()  # flex attention has no CPU backward
def test_attention_backends_agree() -> None:
    model = VisionTransformer(tiny_config()).eval()
    images = torch.randn(2, 3, 8, 8)
    reference = model(images).logits
    for name in blocks.names("attention_backend"):
        model.set_attention_backend(name)
        assert model.config.attention_backend == name
        torch.testing.assert_close(model(images).logits, reference, rtol=1e-4, atol=1e-5)


def test_training_step_reduces_the_loss() -> None:
    model = VisionTransformer(tiny_config(num_labels=2))
    images, labels = torch.randn(8, 3, 8, 8), torch.tensor([0, 1] * 4)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = model(images, labels).loss
    for _ in range(20):
        loss = model(images, labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.5 * first.item()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(pixel_values=torch.zeros(2, 1, 8, 8)), "1 channels, expected num_channels=3"),
        (dict(pixel_values=torch.zeros(2, 3, 8, 5)), "8x5 is not a positive multiple of patch_size=2"),
        (dict(pixel_values=torch.zeros(3, 8, 8)), r"\(B, C, H, W\)"),
        (dict(pixel_values=torch.zeros(2, 3, 8, 8, dtype=torch.long)), "floating point"),
        (dict(pixel_values=torch.zeros(2, 3, 10, 10)), "10x10 differs from the model's image_size=8"),
        (dict(pixel_values=torch.zeros(2, 3, 8, 8), labels=torch.zeros(2, 1, dtype=torch.long)),
         r"labels must have shape \(2,\)"),
        (dict(pixel_values=torch.zeros(2, 3, 8, 8), labels=torch.zeros(2)), "integer class ids"),
        (dict(pixel_values=torch.zeros(2, 3, 8, 8), labels=torch.tensor([0, 5])),
         r"class 5, outside \[0, num_labels=5\)"),
        (dict(pixel_values=torch.zeros(2, 3, 8, 8), labels=torch.tensor([-1, 0])), "class -1"),
    ],
)
def test_bad_input_raises_before_any_computation(kwargs: dict[str, Any], message: str) -> None:
    model = VisionTransformer(tiny_config())
    calls = []
    model.patch_embed.register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(ValueError, match=message):
        model(**kwargs)
    assert not calls


# ------------------------------------------------------------------------------------------ config and presets
def test_config_round_trip_and_json() -> None:
    config = tiny_config(pooling="mean", positional="none", n_kv_heads=1, dropout=0.1)
    data = config.to_dict()
    assert data["d_head"] == 8 and data["n_kv_heads"] == 1
    assert VisionTransformerConfig.from_dict(json.loads(json.dumps(data))) == config
    assert VisionTransformerConfig.from_dict(VisionTransformerConfig().to_dict()) == VisionTransformerConfig()
    with pytest.raises(ValueError, match="vocab_size"):
        VisionTransformerConfig.from_dict({**data, "vocab_size": 10})
    assert config.replace(num_labels=3).num_labels == 3 and config.num_patches == 16


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(image_size=10, patch_size=4), "image_size=10 must be a multiple of patch_size=4"),
        (dict(patch_size=0), "patch_size must be a positive integer, got 0"),
        (dict(num_channels=True), "num_channels must be a positive integer, got True"),
        (dict(num_labels=0), "num_labels must be a positive integer, got 0"),
        (dict(n_heads=3), "d_model=16 is not divisible by n_heads=3"),
        (dict(n_kv_heads=3, n_heads=2), "n_heads=2 must be divisible by n_kv_heads=3"),
        (dict(dropout=1.0), r"dropout must be a float in \[0, 1\), got 1.0"),
        (dict(norm_eps=0), "norm_eps must be a finite number > 0, got 0"),
        (dict(pooling="max"), "pooling='max' is not supported; expected one of \\['cls', 'mean'\\]"),
        (dict(positional="rotary"), "positional='rotary' is not supported"),
        (dict(ffn="nope"), "ffn='nope' is not a registered ffn"),
        (dict(patch_embedding="linear"), "patch_embedding='linear' is not a registered patch_embedding"),
        (dict(bias="yes"), "bias must be a bool, got 'yes'"),
    ],
)
def test_config_rejects_bad_values(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides)


def test_presets() -> None:
    base = VisionTransformer.preset_config("vit-base-patch16-224")
    assert (base.n_layers, base.d_model, base.n_heads, base.d_ff, base.patch_size, base.image_size) == \
        (12, 768, 12, 3072, 16, 224)
    assert (base.num_labels, base.norm_eps, base.ffn, base.sublayer, base.pooling) == \
        (1000, 1e-12, "gelu", "pre_norm", "cls")
    assert base.num_patches == 196
    model = VisionTransformer.from_preset("tiny", num_labels=3)
    assert model(torch.randn(1, 3, 32, 32)).logits.shape == (1, 3)
    with pytest.raises(ValueError, match="unknown VisionTransformer preset 'huge'"):
        VisionTransformer.from_preset("huge")


def test_base_preset_has_the_parameter_count_of_vit_base() -> None:
    config = VisionTransformer.preset_config("vit-base-patch16-224")
    d, layers, ff, p = config.d_model, config.n_layers, config.d_ff, config.patch_size
    per_layer = 4 * (d * d + d) + 2 * d * ff + ff + d + 4 * d
    expected = (3 * p * p * d + d) + d + 197 * d + layers * per_layer + 2 * d + (d * 1000 + 1000)
    assert expected == 86_567_656  # google/vit-base-patch16-224
    with torch.device("meta"):
        assert VisionTransformer(config).num_parameters() == expected


# ------------------------------------------------------------------------------------------ persistence
def test_save_and_load_round_trip(tmp_path: Path) -> None:
    model = perturbed(VisionTransformer(tiny_config(pooling="mean", n_kv_heads=1)))
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architecture"] == "VisionTransformer"
    for loaded in (VisionTransformer.from_pretrained(tmp_path), models.auto.from_pretrained(tmp_path)):
        assert isinstance(loaded, VisionTransformer) and loaded.config == model.config and not loaded.training
        assert loaded.state_dict().keys() == model.state_dict().keys()
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
        images = torch.randn(2, 3, 8, 8)
        torch.testing.assert_close(loaded(images).logits, model(images).logits)


def test_push_to_hub_and_pull(hub: HubServer) -> None:  # noqa: F811
    model = perturbed(VisionTransformer(tiny_config()))
    info = model.push_to_hub("tester/vit-tiny")
    assert hub.repo("tester/vit-tiny").branches["main"] == info.oid
    pulled = VisionTransformer.from_pretrained("tester/vit-tiny")
    assert pulled.config == model.config
    images = torch.randn(2, 3, 8, 8)
    assert torch.equal(pulled(images).logits, model(images).logits)


# ------------------------------------------------------------------------------------------ transformers
HF_VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, image_size=16,
              patch_size=4, num_channels=3, num_labels=5)


def perturbed(model: nn.Module, seed: int = 1234) -> nn.Module:
    """``model`` in eval mode with every parameter moved off its (often symmetric) initial value."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.eval()


def build_hf(model_class: str = "ViTForImageClassification", **overrides: Any) -> nn.Module:
    import transformers
    config = transformers.ViTConfig(**{**HF_VIT, **overrides})
    config._attn_implementation = "eager"  # the implementation that returns attention weights
    return perturbed(getattr(transformers, model_class)(config))


@pytest.mark.parametrize(
    "overrides",
    [{}, {"hidden_act": "gelu_new", "layer_norm_eps": 1e-6, "num_channels": 1, "patch_size": 2,
          "image_size": [16, 16]}],
    ids=["default", "tanh-gelu-1ch"],
)
@torch.no_grad()
def test_logits_match_transformers(tmp_path: Path, overrides: dict[str, Any]) -> None:
    hf = build_hf(**overrides)
    hf.save_pretrained(tmp_path)
    zoo = models.auto.from_pretrained(tmp_path)
    assert isinstance(zoo, VisionTransformer) and not zoo.training
    channels = hf.config.num_channels
    images = torch.randn(3, channels, 16, 16)
    expected = hf(images, output_hidden_states=True, output_attentions=True)
    actual = zoo(images, output_hidden_states=True, output_attentions=True)
    torch.testing.assert_close(actual.logits, expected.logits, atol=1e-4, rtol=0)
    # transformers' last hidden state is the last layer's output before the final norm; the zoo's is after it
    for ours, theirs in zip(actual.hidden_states[:-1], expected.hidden_states[:-1], strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    torch.testing.assert_close(actual.hidden_states[-1], hf.vit.layernorm(expected.hidden_states[-1]),
                               atol=1e-4, rtol=0)
    for ours, theirs in zip(actual.attentions, expected.attentions, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    labels = torch.tensor([0, 4, 2])
    torch.testing.assert_close(zoo(images, labels).loss, hf(images, labels=labels).loss, atol=1e-5, rtol=0)
    # other image sizes: bicubic interpolation of the position table, as transformers does it
    for height, width in ((24, 24), (20, 12)):
        other = torch.randn(2, channels, height, width)
        torch.testing.assert_close(zoo(other, interpolate_pos_encoding=True).logits,
                                   hf(other, interpolate_pos_encoding=True).logits, atol=1e-4, rtol=0)


@torch.no_grad()
def test_in_memory_state_dict_converts_too() -> None:
    hf = build_hf()
    converted = from_transformers(hf.config.to_dict(), hf.state_dict())  # transformers 5's in-memory names
    assert converted.architecture is VisionTransformer and not converted.allow_missing
    zoo = VisionTransformer(converted.config)
    zoo.load_state_dict(converted.state_dict)
    images = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(zoo.eval()(images).logits, hf(images).logits, atol=1e-4, rtol=0)


@torch.no_grad()
def test_vit_model_checkpoint_leaves_the_classifier_missing(tmp_path: Path) -> None:
    hf = build_hf("ViTModel")
    hf.save_pretrained(tmp_path)
    config, state_dict = json.loads((tmp_path / "config.json").read_text()), load_file(tmp_path / "model.safetensors")
    assert "pooler.dense.weight" in state_dict and not any(k.startswith("vit.") for k in state_dict)
    with pytest.warns(UserWarning, match="pooler"):
        converted = from_transformers(config, state_dict)
    assert converted.allow_missing == {"classifier.weight", "classifier.bias"}
    zoo = VisionTransformer(converted.config).eval()
    result = zoo.load_state_dict(converted.state_dict, strict=False)
    assert set(result.missing_keys) == converted.allow_missing and not result.unexpected_keys
    images = torch.randn(2, 3, 16, 16)
    last, _, _ = zoo.encode(images)
    torch.testing.assert_close(last, hf(images).last_hidden_state, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(qkv_bias=False), "qkv_bias=False"),
        (dict(image_size=[16, 32]), "image_size=\\[16, 32\\] \\(non-square"),
        (dict(hidden_act="quick_gelu"), "hidden_act='quick_gelu'"),
        (dict(image_size=18), "image_size=18 must be a multiple of patch_size=4"),
        (dict(hidden_size=40), "checkpoint tensor for 'cls_token' has shape \\(1, 1, 32\\)"),
    ],
)
def test_unsupported_or_inconsistent_checkpoints_raise(change: dict[str, Any], message: str) -> None:
    hf = build_hf()
    config = {**hf.config.to_dict(), **change}
    with pytest.raises(ValueError, match=message):
        from_transformers(config, hf.state_dict())


def test_parts_of_other_vit_heads_are_named() -> None:
    hf = build_hf()
    state_dict = {**hf.state_dict(), "vit.embeddings.mask_token": torch.zeros(1, 1, 32)}
    with pytest.raises(ValueError, match="vit.embeddings.mask_token|embeddings.mask_token"):
        from_transformers(hf.config.to_dict(), state_dict)
    state_dict = dict(hf.state_dict())
    del state_dict["vit.layers.1.mlp.fc2.bias"]
    with pytest.raises(ValueError, match="encoder.layer.1.output.dense.bias"):
        from_transformers(hf.config.to_dict(), state_dict)


@torch.no_grad()
def test_export_loads_in_transformers_and_converts_back(tmp_path: Path) -> None:
    import transformers
    zoo = perturbed(VisionTransformer(tiny_config(norm_eps=1e-6, ffn="gelu_tanh")))
    save_transformers(zoo, tmp_path)
    hf, info = transformers.ViTForImageClassification.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    images = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(hf.eval()(images).logits, zoo(images).logits, atol=1e-4, rtol=0)
    back = from_transformers(*to_transformers(zoo))
    assert back.config == zoo.config
    assert all(torch.equal(back.state_dict[k], v) for k, v in zoo.state_dict().items())
    with pytest.raises(ValueError, match="as 'vit': pooling='mean' \\(only 'cls'\\)"):
        to_transformers(VisionTransformer(tiny_config(pooling="mean")), "vit")
    with pytest.raises(ValueError, match="vit: positional='none'"):  # no family fits: every reason is given
        to_transformers(VisionTransformer(tiny_config(positional="none")))


# ------------------------------------------------------------------------------------------ example
def test_digits_example_runs_and_rejects_zero_steps() -> None:
    """A smoke run of the script's command line; its accuracy is asserted in tests/training/test_examples.py."""
    import sklearn  # noqa: F401  (missing, the test fails)
    spec = importlib.util.spec_from_file_location("vit_digits", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    accuracy = example.main(["--steps", "2", "--eval-every", "1", "--d-model", "16", "--layers", "1"])
    assert isinstance(accuracy, float)
    with pytest.raises(SystemExit):
        example.main(["--steps", "0"])
