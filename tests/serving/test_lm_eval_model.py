"""The ``zoo`` lm-evaluation-harness backend against lm-eval's own ``hf`` backend on the same checkpoint: the same
per-sample log-likelihoods (a multiple-choice task, a rolling-window perplexity task with texts longer than the
context) and the same generations and accuracy (a generation task), on local task files written here."""

from __future__ import annotations

import json
import math

import pytest

TASKS = {
    "zoo_mc": ("multiple_choice", {"doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}",
                                   "doc_to_target": "{{answer}}", "metric_list": [{"metric": "acc"},
                                                                                  {"metric": "acc_norm"}]}),
    "zoo_gen": ("generate_until", {"doc_to_text": "{{question}}", "doc_to_target": "{{answer}}",
                                   "generation_kwargs": {"until": ["\n", "."], "max_gen_toks": 6, "do_sample": False},
                                   "metric_list": [{"metric": "exact_match"}]}),
    "zoo_ppl": ("loglikelihood_rolling", {"doc_to_text": "", "doc_to_target": "{{text}}", "metric_list": [
        {"metric": "word_perplexity"}, {"metric": "byte_perplexity"}]}),
}
DOCS = {
    "zoo_mc": [{"question": q, "choices": c, "answer": a} for q, c, a in [
        ("The capital of France is", [" Paris", " Berlin", " the lazy dog"], 0),
        ("2+2=", ["4", "6", " fox"], 0),
        ("The quick brown", [" fox", " dog", " capital of Germany"], 1),
        ("", [" Paris", " Berlin"], 1),
        ("What does the function do? ", ["It returns the answer.", "The fox."], 0)]],
    "zoo_gen": [{"question": q, "answer": a} for q, a in [
        ("The quick brown fox", " jumps"), ("Paris is the", " capital"), ("2+2=", "4"), ("What does", " the")]],
    "zoo_ppl": [{"text": t} for t in ["The quick brown fox jumps over the lazy dog. " * 6,
                                      "Paris is the capital of France.", "Berlin is the capital of Germany. " * 3]],
}


def write_tasks(folder) -> None:
    for name, (kind, fields) in TASKS.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in DOCS[name]))
        config = {"task": name, "dataset_path": "json", "output_type": kind, "test_split": "test",
                  "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(folder / "cache")},
                  **fields}
        (folder / f"{name}.yaml").write_text(json.dumps(config))  # JSON is YAML


@pytest.fixture(scope="module")
def results(tiny_llama_dir, tmp_path_factory):
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    import serving.lm_eval_model  # noqa: F401 - registers "zoo"

    folder = tmp_path_factory.mktemp("tasks")
    write_tasks(folder)
    manager = TaskManager(include_path=str(folder), include_defaults=False)  # indexing lm-eval's own tasks takes ~25 s
    out = {}
    for name, model in [("hf", HFLM(pretrained=str(tiny_llama_dir), batch_size=3, max_length=24, device="cpu",
                                    dtype="float32")),
                        ("zoo", lm_eval.api.registry.get_model("zoo").create_from_arg_string(
                            f"pretrained={tiny_llama_dir},max_length=24", {"batch_size": 3}))]:
        out[name] = lm_eval.simple_evaluate(model=model, tasks=list(TASKS), task_manager=manager, log_samples=True,
                                            random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                            fewshot_random_seed=0, bootstrap_iters=0)
    return out


def per_sample(result, task):
    return [(s["doc_id"], s["resps"]) for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


@pytest.mark.parametrize("task", ["zoo_mc", "zoo_ppl"])
def test_log_likelihoods_equal_the_hf_backend(results, task: str) -> None:
    ours, theirs = per_sample(results["zoo"], task), per_sample(results["hf"], task)
    assert len(ours) == len(theirs) == len(DOCS[task])
    values = 0
    for (doc, mine), (_, ref) in zip(ours, theirs, strict=True):
        for a, b in zip(mine, ref, strict=True):
            a, b = a[0], b[0]
            if isinstance(a, (list, tuple)):  # (logprob, is_greedy)
                assert a[0] == pytest.approx(b[0], abs=1e-4), doc
                assert a[1] == b[1], doc
            else:
                assert a == pytest.approx(b, abs=1e-4), doc
            values += 1
    assert values >= len(DOCS[task])
    for metric, value in results["hf"]["results"][task].items():
        if isinstance(value, float) and not metric.endswith("stderr,none"):
            assert results["zoo"]["results"][task][metric] == pytest.approx(value, rel=1e-5), metric


def test_generations_and_accuracy_equal_the_hf_backend(results) -> None:
    ours, theirs = per_sample(results["zoo"], "zoo_gen"), per_sample(results["hf"], "zoo_gen")
    assert [r for _, r in ours] == [r for _, r in theirs]
    assert any(r[0][0] for _, r in ours)  # something was generated
    got = results["zoo"]["results"]["zoo_gen"]["exact_match,none"]
    assert got == results["hf"]["results"]["zoo_gen"]["exact_match,none"]
    assert not math.isnan(got)


def test_unknown_model_args_are_refused(tiny_llama_dir) -> None:
    from serving.lm_eval_model import ZooLM

    with pytest.raises(ValueError, match=r"unknown model_args .*\['temprature'\]"):
        ZooLM(str(tiny_llama_dir), temprature=0.5)
    with pytest.raises(ValueError, match="batch_size"):
        ZooLM(str(tiny_llama_dir), batch_size=0)
