"""``zoo finetune`` (sft and dpo with LoRA; a rerun resumes from the newest checkpoint and ends where an unbroken run
ends), ``zoo merge`` (the merged model computes what base + adapter computes), ``zoo convert`` (transformers loads
the same logits), ``zoo eval`` on a local task (slow) and ``zoo perplexity``; bad data exits with the file and line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml

import models
from cli.main import main
from tests.tiny_checkpoint import CORPUS

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2="},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3="}, {"role": "assistant", "content": "6"}],
    [{"role": "user", "content": "The quick brown"}, {"role": "assistant", "content": "fox jumps over the lazy dog."}],
]
PAIRS = [{"prompt": "The capital of France is", "chosen": " Paris.", "rejected": " Berlin."},
         {"prompt": "2+2=", "chosen": "4", "rejected": "6"}]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    (folder / "chat.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS))
    (folder / "prefs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    return folder


def finetune(base, files, out, method="sft", steps=4):
    data = files / ("chat.jsonl" if method == "sft" else "prefs.jsonl")
    main(["finetune", str(base), "--data", str(data), "--method", method, "--lora", "--lora-r", "4", "--out",
          str(out), "--steps", str(steps), "--batch-size", "2", "--checkpoint-every", "2", "--max-length", "48",
          "--lr", "1e-2", "--no-progress"])
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def sft_run(tiny_llama_dir, files, tmp_path_factory):
    out = tmp_path_factory.mktemp("sft")
    return out, finetune(tiny_llama_dir, files, out)


def adapter_weights(folder):
    from safetensors.torch import load_file

    return load_file(folder / "adapter_model.safetensors")


def test_sft_trains_an_adapter_and_a_rerun_resumes_exactly(tiny_llama_dir, files, sft_run, tmp_path, capsys) -> None:
    out, summary = sft_run
    assert summary["steps"] == 4 and summary["method"] == "sft"
    assert (out / "adapter" / "adapter_config.json").is_file()
    again = tmp_path / "again"
    shutil.copytree(out / "checkpoints", again / "checkpoints")
    shutil.rmtree(sorted((again / "checkpoints").iterdir())[-1])  # as if stopped after step 2
    finetune(tiny_llama_dir, files, again)
    assert "resuming from" in capsys.readouterr().out
    ref, got = adapter_weights(out / "adapter"), adapter_weights(again / "adapter")
    assert ref.keys() == got.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=1e-6, rtol=1e-6, msg=name)


def test_finetune_schedules_the_learning_rate(tiny_llama_dir, files, tmp_path) -> None:
    from cli.finetune import build
    from cli.main import parser
    from training.schedules import warmup_cosine_rate

    def rates(*options):
        args = parser()[0].parse_args(["finetune", str(tiny_llama_dir), "--data", str(files / "chat.jsonl"), "--out",
                                       str(tmp_path), "--steps", "10", "--lr", "0.5", *options])
        _, trainer = build(args)
        out = []
        for _ in range(10):
            out.append(trainer.optimizer.param_groups[0]["lr"])
            trainer.optimizer.step()
            if trainer.scheduler is not None:
                trainer.scheduler.step()
        return out

    assert rates() == [0.5] * 10
    assert rates("--warmup", "4") == pytest.approx([0.125, 0.25, 0.375] + [0.5] * 7)
    assert rates("--schedule", "cosine", "--warmup", "2") == pytest.approx(
        [0.5 * warmup_cosine_rate(step, 2, 10) for step in range(1, 11)])
    with pytest.raises(SystemExit, match="--warmup must be an integer >= 0"):
        main(["finetune", str(tiny_llama_dir), "--data", str(files / "chat.jsonl"), "--out", str(tmp_path),
              "--warmup", "-1"])


def test_dpo_runs_from_the_sft_adapter_merged(tiny_llama_dir, files, sft_run, tmp_path) -> None:
    merged = tmp_path / "merged"
    main(["merge", str(tiny_llama_dir), str(sft_run[0] / "adapter"), "--out", str(merged)])
    base = models.from_pretrained(tiny_llama_dir).eval()
    base.load_adapter(sft_run[0] / "adapter")
    ids = torch.tensor([base.tokenizer.encode("The quick brown fox")])
    with torch.no_grad():
        torch.testing.assert_close(models.from_pretrained(merged).eval()(ids).logits, base(ids).logits,
                                   atol=1e-4, rtol=1e-4)  # W + BA rounds differently from W x + B(A x)
    summary = finetune(merged, files, tmp_path / "dpo", method="dpo", steps=2)
    assert summary["steps"] == 2 and "rewards/margins" in summary
    main(["convert", str(merged), "--to", "transformers", "--out", str(tmp_path / "hf")])
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, base(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # lm-eval's run itself is covered against the hf backend in tests/serving/test_lm_eval_model.py
def test_eval(tiny_llama_dir, tmp_path, capsys) -> None:
    docs = [{"q": "The capital of France is", "choices": [" Paris", " Berlin"], "a": 0},
            {"q": "2+2=", "choices": ["4", "6"], "a": 0}]
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "mc.yaml").write_text(yaml.safe_dump({
        "task": "zoo_cli_mc", "dataset_path": "json", "output_type": "multiple_choice", "test_split": "test",
        "dataset_kwargs": {"data_files": {"test": str(tmp_path / "mc.jsonl")}, "cache_dir": str(tmp_path / "c")},
        "doc_to_text": "{{q}}", "doc_to_choice": "{{choices}}", "doc_to_target": "{{a}}",
        "metric_list": [{"metric": "acc"}]}))
    main(["eval", str(tiny_llama_dir), "--tasks", "zoo_cli_mc", "--include-path", str(tmp_path), "--output",
          str(tmp_path / "results.json")])
    results = json.loads((tmp_path / "results.json").read_text())
    assert 0.0 <= results["results"]["zoo_cli_mc"]["acc,none"] <= 1.0
    assert "zoo_cli_mc" in capsys.readouterr().out


def test_perplexity(tiny_llama_dir, tmp_path, capsys) -> None:
    (tmp_path / "text.txt").write_text(" ".join(CORPUS))
    main(["perplexity", str(tiny_llama_dir), str(tmp_path / "text.txt"), "--ctx", "16", "--no-progress"])
    printed = capsys.readouterr().out
    assert printed.startswith("[1]") and "Final estimate: PPL = " in printed


def test_bad_data_exits_with_the_file_and_line(tiny_llama_dir, tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": CHATS[0]}) + "\n" + '{"messages": [{"role": "user"}]}\n')
    with pytest.raises(SystemExit, match=r"bad\.jsonl, line 2: messages\[0\] \(user\) has no 'content'"):
        main(["finetune", str(tiny_llama_dir), "--data", str(bad), "--out", str(tmp_path / "o"), "--no-progress"])
