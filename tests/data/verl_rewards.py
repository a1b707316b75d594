"""Reward functions written the way verl users write them (``compute_score``), for the convention tests."""

import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 when every record field arrived as verl passes it (a dict, as verl's rewards may return):
    the ground truth is twice ``extra_info["index"]`` and ``data_source`` names the set."""
    ok = (data_source == "openai/gsm8k" and isinstance(solution_str, str) and isinstance(extra_info, dict)
          and extra_info.get("split") == "train" and ground_truth == str(2 * extra_info["index"]))
    return {"score": 1.0 if ok else 0.0, "acc": ok}


def strict_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    """verl's gsm8k style: regex on the strings (a TypeError on anything else); a float plus ``bonus``."""
    found = re.search(r"\d+", solution_str)
    matched = re.fullmatch(r"\d+", ground_truth) is not None
    return float(matched) * 0.5 + (0.5 if found else 0.0) + bonus


def answer_free(data_source, solution_str, ground_truth=None, extra_info=None):
    """Reads no answer (its ground_truth has a default)."""
    return float(len(solution_str))


def undecorated_grader(response, answer):
    """A per-sample grader without @grader: no calling convention fits it."""
    return float(response == answer)


def scaled_batch(prompts, responses, answers, scale):
    """A batch function whose required ``scale`` comes from reward.kwargs."""
    return [scale * len(r) for r in responses]


def scaled_verl(data_source, solution_str, ground_truth, scale, extra_info=None):
    """A verl function whose required ``scale`` comes from reward.kwargs."""
    return scale * float(solution_str == ground_truth)
