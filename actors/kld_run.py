"""`glm53 kld`: capture a teacher's logits over fixed token windows into a directory, then
score a student configuration against them into a JSON receipt (the math: kld.py).

Teacher directory (`capture`): `manifest.json` and one `window-NNNNN.safetensors` per window,
holding `tokens` [W] int64 and `logits` [W - 1, V] (the scored rows; float32 by default, as the
reference's full-vocabulary teacher, or bfloat16 at half the bytes: 0.6 GiB a 2,048-token
window at GLM's 154,880 ids instead of 1.2 GiB; a bf16 teacher is itself rounded, so a student
identical to it scores ~1e-6, not 0). The manifest holds the window size, the SHA-256 of the
tokens, of every window file and of the inputs the caller names (the corpus, the model), and
the teacher's RunConfig. Scoring reads the logits `chunk` rows at a time (safetensors slices),
checks each window file's SHA-256 and refuses a student of another vocabulary, or of another
model unless asked (`other_model`), naming the digests.

The receipt holds no timestamps: the same teacher, student and software give the same bytes;
`receipt_sha256` seals the rest of it (SHA-256 of its canonical JSON). Runs in this process on
one device (TP1): a model that needs a GPU pair is out of its reach until the workers can
return full logits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import kld
from .kv_scale_bank import bank_path, load_scale_bank
from .loader import DTYPES, load_model, read_config
from .models.glm5_next import Glm5NextForCausalLM

TEACHER_FORMAT = "glm53-kld-teacher/1"
RECEIPT_FORMAT = "glm53-kld-receipt/1"
MANIFEST = "manifest.json"
LOGITS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class KLDInputError(ValueError):
    """Inputs that cannot be scored together (missing, mismatched or malformed)."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """How a model runs over the windows (the teacher's or the student's configuration).
    `model_digest` names the checkpoint's files (the caller computes it)."""

    model: str
    model_digest: str
    kv_cache_dtype: str = "bf16"
    kv_scale_bank: str | None = None  # nvfp4: default BANK_FILE in the checkpoint
    quantize_experts: str | None = None
    dtype: str | None = None  # default: the checkpoint's
    device: str = "cpu"
    block_size: int = 16
    prefill_chunk: int | None = None  # tokens per prefill step (None: the whole window)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def tokens_sha256(windows: np.ndarray) -> str:
    """SHA-256 of the windows [N, W] as little-endian int64."""
    return sha256_bytes(np.ascontiguousarray(windows, dtype="<i8").tobytes())


def cut_windows(tokens: list[int], window: int, max_windows: int | None = None) -> np.ndarray:
    """Non-overlapping windows [N, window] from the start of `tokens` (a partial last window
    is dropped), at most `max_windows` of them."""
    if window < 2:
        raise KLDInputError(f"window {window}: at least 2 tokens (W - 1 positions are scored)")
    n = len(tokens) // window
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise KLDInputError(f"the corpus holds {len(tokens)} tokens, fewer than one window of "
                            f"{window}")
    return np.asarray(tokens[:n * window], dtype=np.int64).reshape(n, window)


def _scales(cfg: RunConfig, kv_cache_dtype: str) -> tuple[dict[str, float] | None, str | None]:
    """(nvfp4 scale bank, its SHA-256) when `kv_cache_dtype` needs it, else (None, None)."""
    if kv_cache_dtype != "nvfp4":
        return None, None
    path = bank_path(cfg.model, cfg.kv_scale_bank)
    return load_scale_bank(path), sha256_file(path)


def check_window(model_dir: str | Path, window: int) -> None:
    """Refuse a window longer than the model's context."""
    limit = read_config(model_dir).max_position_embeddings
    if window > limit:
        raise KLDInputError(f"window {window} is longer than the model's context "
                            f"(max_position_embeddings {limit})")


def load(cfg: RunConfig, window: int) -> Glm5NextForCausalLM:
    """The model of `cfg` (no MTP layer: no draft alters the logits), refusing a window
    longer than its context before loading it."""
    check_window(cfg.model, window)
    return load_model(cfg.model, dtype=DTYPES[cfg.dtype] if cfg.dtype else None,
                      device=cfg.device, progress=False, quantize_experts=cfg.quantize_experts)


def _config_json(cfg: RunConfig, kv_cache_dtype: str | None = None) -> dict:
    out = dataclasses.asdict(cfg)
    out["kv_scale_bank_sha256"] = _scales(cfg, kv_cache_dtype or cfg.kv_cache_dtype)[1]
    return out


def capture(cfg: RunConfig, windows: np.ndarray, out: str | Path, inputs: dict,
            logits_dtype: str = "float32") -> dict:
    """Run the teacher `cfg` over windows [N, W] and write the teacher directory `out`;
    `inputs` (e.g. the corpus's SHA-256) go into the manifest. Returns the manifest."""
    out = Path(out)
    if (out / MANIFEST).exists():
        raise KLDInputError(f"{out} already holds a teacher; remove it or choose another path")
    n, w = windows.shape
    model = load(cfg, w)
    spec = kld.CacheSpec(cfg.kv_cache_dtype, _scales(cfg, cfg.kv_cache_dtype)[0], cfg.block_size)
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for i, ids in enumerate(windows):
        logits = kld.window_logits(model, ids.tolist(), spec, cfg.prefill_chunk)[:-1]
        name = f"window-{i:05d}.safetensors"
        save_file({"tokens": torch.from_numpy(ids.copy()),
                   "logits": logits.to(LOGITS_DTYPES[logits_dtype]).cpu().contiguous()},
                  str(out / name))
        files[name] = sha256_file(out / name)
    manifest = {"format": TEACHER_FORMAT, "window": w, "windows": n,
                "positions_per_window": w - 1, "vocab_size": model.config.vocab_size,
                "logits_dtype": logits_dtype, "tokens_sha256": tokens_sha256(windows),
                "inputs": inputs, "teacher": _config_json(cfg), "files": files}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def read_manifest(teacher: str | Path) -> dict:
    path = Path(teacher) / MANIFEST
    if not path.is_file():
        raise KLDInputError(f"no teacher at {teacher} ({MANIFEST} missing): capture one with "
                            "`glm53 kld capture`")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != TEACHER_FORMAT:
        raise KLDInputError(f"{path} is not a KLD teacher (format {TEACHER_FORMAT!r})")
    return manifest


def _teacher_windows(teacher: Path, manifest: dict) -> Iterator[tuple[np.ndarray, object]]:
    """(tokens [W], open safetensors file) of each window, its SHA-256 checked first."""
    for name, digest in sorted(manifest["files"].items()):
        path = teacher / name
        if not path.is_file():
            raise KLDInputError(f"teacher window {path} is missing")
        if sha256_file(path) != digest:
            raise KLDInputError(f"teacher window {path} changed: sha256 {sha256_file(path)}, "
                                f"the manifest says {digest}")
        with safe_open(str(path), framework="pt") as f:
            yield f.get_tensor("tokens").numpy(), f


def check_inputs(manifest: dict, inputs: dict) -> None:
    """Refuse when a digest the caller gives (corpus, tokens) differs from the teacher's."""
    recorded = {**manifest["inputs"], "tokens_sha256": manifest["tokens_sha256"]}
    for key, value in inputs.items():
        if key in recorded and recorded[key] != value:
            raise KLDInputError(f"the teacher was captured from other inputs: {key} "
                                f"{recorded[key]}, here {value}")


def _score_windows(model: Glm5NextForCausalLM, teacher: Path, manifest: dict,
                   spec: kld.CacheSpec, prefill_chunk: int | None, chunk: int,
                   with_nll: bool = True) -> dict[str, np.ndarray]:
    """Tokenwise arrays [N, W - 1] over every teacher window: kl (float64), agree (bool) and,
    `with_nll`, the teacher's and the student's NLL of the next token."""
    device = model.embed_tokens.weight.device
    out: dict[str, list] = {"kl": [], "agree": [], "nll_teacher": [], "nll_student": []}
    for tokens, f in _teacher_windows(teacher, manifest):
        student = kld.window_logits(model, tokens.tolist(), spec, prefill_chunk)[:-1]
        targets = torch.from_numpy(tokens[1:]).to(device)
        rows = f.get_slice("logits")
        kls, agree, nll_t = [], [], []
        for a in range(0, student.shape[0], chunk):
            t = rows[a:a + chunk].to(device)
            k, g = kld.kl_rows(t, student[a:a + chunk], chunk)
            kls.append(k)
            agree.append(g)
            if with_nll:
                nll_t.append(kld.nll_rows(t, targets[a:a + chunk], chunk))
        out["kl"].append(torch.cat(kls).cpu().numpy())
        out["agree"].append(torch.cat(agree).cpu().numpy())
        if with_nll:
            out["nll_teacher"].append(torch.cat(nll_t).cpu().numpy())
            out["nll_student"].append(kld.nll_rows(student, targets, chunk).cpu().numpy())
    return {k: np.stack(v) for k, v in out.items() if v}


def _check_student(manifest: dict, cfg: RunConfig, vocab_size: int, other_model: bool) -> None:
    if vocab_size != manifest["vocab_size"]:
        raise KLDInputError(f"the student's vocabulary holds {vocab_size} ids, the teacher's "
                            f"{manifest['vocab_size']}")
    captured = manifest["teacher"]["model_digest"]
    if cfg.model_digest != captured and not other_model:
        raise KLDInputError(f"the teacher was captured from another model: sha256 {captured}, "
                            f"the student's {cfg.model_digest} (to score another checkpoint "
                            "against it, say so: --other-model)")


def _check_breakdown(manifest: dict, cfg: RunConfig) -> None:
    t = manifest["teacher"]
    same = all(t[k] == getattr(cfg, k) for k in ("model_digest", "quantize_experts", "dtype"))
    if not same or t["kv_cache_dtype"] == cfg.kv_cache_dtype:
        raise KLDInputError("the per-layer breakdown ablates the cache: the student must differ "
                            "from the teacher in --kv-cache-dtype only")


def _breakdown(model, teacher: Path, manifest: dict, cfg: RunConfig, chunk: int) -> dict:
    """Mean KLD with the student's cache dtype on one DSA layer, or on one cached part, and
    the teacher's elsewhere (kld.py: cache ablation)."""
    t = manifest["teacher"]
    scales = _scales(cfg, "nvfp4")[0] if "nvfp4" in (cfg.kv_cache_dtype,
                                                    t["kv_cache_dtype"]) else None

    def mean(**mix) -> float:
        spec = kld.CacheSpec(cfg.kv_cache_dtype, scales, cfg.block_size,
                             base_dtype=t["kv_cache_dtype"], **mix)
        return float(_score_windows(model, teacher, manifest, spec, cfg.prefill_chunk, chunk,
                                    with_nll=False)["kl"].mean())

    return {"by_layer": {str(i): mean(mix_layers=(str(i),))
                         for i in model.config.dsa_layers},
            "by_part": {part: mean(mix_parts=(part,)) for part in kld.CACHE_PARTS},
            "kda_layers": "no cached state changes with the cache dtype (fp32 recurrent state)"}


def score(teacher: str | Path, cfg: RunConfig, chunk: int = 64, breakdown: bool = False,
          other_model: bool = False, inputs: dict | None = None) -> dict:
    """The receipt (a JSON-ready dict) of the student `cfg` against the teacher directory.
    `inputs`: digests the caller recomputed (corpus, tokens), refused if they differ."""
    teacher = Path(teacher)
    manifest = read_manifest(teacher)
    check_inputs(manifest, inputs or {})
    if breakdown:
        _check_breakdown(manifest, cfg)
    model = load(cfg, manifest["window"])
    _check_student(manifest, cfg, model.config.vocab_size, other_model)
    spec = kld.CacheSpec(cfg.kv_cache_dtype, _scales(cfg, cfg.kv_cache_dtype)[0], cfg.block_size)
    arrays = _score_windows(model, teacher, manifest, spec, cfg.prefill_chunk, chunk)
    kl = arrays["kl"]
    receipt = {
        "format": RECEIPT_FORMAT,
        "teacher": {"manifest_sha256": sha256_file(teacher / MANIFEST),
                    "tokens_sha256": manifest["tokens_sha256"], "inputs": manifest["inputs"],
                    "config": manifest["teacher"], "logits_dtype": manifest["logits_dtype"]},
        "student": _config_json(cfg),
        "window": manifest["window"], "windows": int(kl.shape[0]),
        "positions": int(kl.size), "chunk": chunk,
        "kld": kld.summarise(kl), "top1_agreement": float(arrays["agree"].mean()),
        "nll": {"teacher": float(arrays["nll_teacher"].mean()),
                "student": float(arrays["nll_student"].mean())},
        "by_position": kld.by_position(kl),
        "by_window": [float(x) for x in kl.mean(axis=1)],
        "tokenwise_kld_sha256": sha256_bytes(np.ascontiguousarray(kl, "<f8").tobytes()),
        "software": {"torch": torch.__version__},
    }
    if breakdown:
        receipt["breakdown"] = _breakdown(model, teacher, manifest, cfg, chunk)
    receipt["receipt_sha256"] = sha256_bytes(json.dumps(receipt, sort_keys=True).encode())
    return receipt
