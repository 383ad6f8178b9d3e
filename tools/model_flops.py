"""Model FLOPs of one training step, counted from a run's shapes (tools/bench-peers, tools/gpu-bench)."""
import json
import os


def model_flops_per_step(run_dir, resolved):
    """(FLOPs, matrix parameters) of one step of the run in `run_dir` (its init.safetensors header and its
    resolved config `resolved`): 6 x the matrix parameters per token (every 2-D weight but the
    embedding tables; a table tied to the output projection counts once, as that projection), plus
    attention's score and value products, 12 x layers x dim x seq per token (PaLM's 6N + 12 L d S).
    A mixture-of-experts model's stacked experts ([n_experts, ., .] weights) count top_k / n_experts
    of their parameters: those each token goes through."""
    with open(os.path.join(run_dir, "init.safetensors"), "rb") as f:  # its header: names, dtypes, shapes
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    shapes = {name: e["shape"] for name, e in header.items() if name != "__metadata__"}
    n = sum(s[0] * s[1] for name, s in shapes.items() if len(s) == 2 and "embeddings" not in name)
    a = resolved["model"]["args"]
    if a.get("n_experts"):
        n += sum(s[0] * s[1] * s[2] for name, s in shapes.items() if len(s) == 3 and ".experts." in name
                 ) * a.get("top_k", 1) // a["n_experts"]
    if a.get("weight_tying") and "output.weight" not in shapes and "tok_embeddings.weight" in shapes:
        s = shapes["tok_embeddings.weight"]
        n += s[0] * s[1]
    seq, batch = resolved["data"]["seq_len"], resolved["train"]["global_batch"]
    per_token = 6 * n + 12 * a.get("n_layers", 0) * a.get("dim", 0) * seq
    return per_token * seq * batch, n
