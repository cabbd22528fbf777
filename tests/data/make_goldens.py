"""Regenerates (or checks) the goldens in ``tests/data`` by running DeepSeek's reference code.

The reference is DeepSeek-V4.1-Flash's ``inference/`` code in the CPU port vendored by ``tenstorrent/tt-metal``
(``models/demos/deepseek_v3_d_p/reference/deepseek_v41/``). It is not part of this repository: fetch it into a
folder of its own and pass that folder (see README.md next to this file). Two sets of goldens: logits (and a few
captures) of the ``v41_tiny_vl`` fixture weights on three prompts, and the ``v41_tiny_dspark`` fixture's protocol
(prefill, ring seeding, teacher-forced decode steps each with a draft call, full pass). Its sources must be the
versions the fixtures were made with: their sha256 are checked against ``../shared/fixtures/v41_tiny_vl/meta.json``. A
third golden: a seeded fine-tune of the dense fixture exported with ``dsv41 export --format released``, loaded by the
reference from the exported folder (:func:`load_released`) and decoded greedily.

The reference runs unmodified on the fixture weights inside ``modeling_dsv41.numerics.reference_numerics()`` of
the checkout this script lives in, so that rerunning it after the mode changes makes the matching goldens. The
only patch is the fixtures' own "noqdq" one: ``model.act_quant`` / ``model.fp4_act_quant`` become identities.
``--native`` drops the mode and patches only the ViT's fused attention (see :func:`numerics`).

    python tests/data/make_goldens.py --reference /tmp/dsref            # writes tests/data/*.safetensors
    python tests/data/make_goldens.py --reference /tmp/dsref --check    # compares with them bit for bit
    python tests/data/make_goldens.py --reference /tmp/dsref --native   # native products vs the shipped fixtures
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib
import importlib.util
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from unittest import mock

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "tests")]
from modeling_dsv41.numerics import portable_attention, reference_numerics  # noqa: E402
from reference_fixture import EXPORT_NEW_TOKENS, export_prompt, export_read_files, released_finetune  # noqa: E402

FIXTURE = REPO_ROOT.parent / "shared" / "fixtures" / "v41_tiny_vl"
DSPARK_FIXTURE = REPO_ROOT.parent / "shared" / "fixtures" / "v41_tiny_dspark"
DATA = Path(__file__).resolve().parent
# golden file → (QDQ mode, prompts): each holds ``{variant}_{prompt}_logits`` for both variants
GOLDENS = {
    "reference_noqdq.safetensors": ("noqdq", ("fixture", "text", "image")),
    "reference_qdq.safetensors": ("qdq", ("fixture", "text", "image")),
}
VARIANTS = ("dense", "sparse")
# DSpark golden file → QDQ mode: the keys of the DSpark fixture's ``expected_{mode}`` (its README §2 protocol)
DSPARK_GOLDENS = {
    "reference_dspark_noqdq.safetensors": "noqdq",
    "reference_dspark_qdq.safetensors": "qdq",
}
# the released export's golden: prompt, greedy tokens and each step's logits, the read files' sha256 in its metadata
EXPORT_GOLDEN = "reference_export.safetensors"
CAPTURED = ("dense", "fixture")  # the (variant, prompt) whose layer-0 attention and ViT captures are stored too
REFERENCE_FILES = ("__init__.py", "model.py", "kernel_cpu.py", "engram.py", "vision.py", "image_processor.py")
PACKAGE = "deepseek_v41_reference"


@dataclasses.dataclass
class Prompt:
    """One forward's inputs in the reference's form: ids [1, S], token types [1, S] (-1 text, 0-3 the image span's
    START/IMAGE/NEWLINE/END) and at most one image as ``(start, patches, n_vit_h, n_vit_w)``."""

    input_ids: torch.Tensor
    token_types: torch.Tensor | None
    image: tuple[int, torch.Tensor, int, int] | None


def import_reference(folder: Path) -> ModuleType:
    """The reference's ``model`` module, imported as a package from ``folder`` once its sources are checked."""
    expected = json.loads((FIXTURE / "meta.json").read_text())["reference_sha256"]
    for name in REFERENCE_FILES:
        digest = hashlib.sha256((folder / name).read_bytes()).hexdigest()
        if digest != expected[name]:
            raise SystemExit(f"{folder / name}: sha256 {digest}, the fixtures were made with {expected[name]}")
    spec = importlib.util.spec_from_file_location(
        PACKAGE, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = package
    spec.loader.exec_module(package)
    return importlib.import_module(f"{PACKAGE}.model")


class TokenMapTokenizer:
    """The two methods ``build_compressed_token_map`` calls, answering with the fixture's compressed token map
    (one distinct text per compressed id), so that the reference's own ``NgramHashState`` rebuilds it."""

    def __init__(self, token_map: torch.Tensor):
        self.token_map = token_map.tolist()
        self.backend_tokenizer = self

    def __len__(self) -> int:
        return len(self.token_map)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return f"c{self.token_map[ids[0]]}"


def build_model(ref: ModuleType, config: dict, folder: Path, max_seq_len: int) -> torch.nn.Module:
    """The reference ``Transformer`` of a fixture config with the weights and Engram state in ``folder``.
    ``max_seq_len`` only sizes the caches (RoPE tables are per position), so it is raised to fit the longest
    prompt."""
    args = ref.ModelArgs(**{**config, "max_seq_len": max(config["max_seq_len"], max_seq_len)})
    engram = load_file(folder / "engram.safetensors")
    with ref.set_dtype(torch.bfloat16):
        model = ref.Transformer(args, TokenMapTokenizer(engram["token_map"])).eval()
    # the DSpark fixture also stores the shared ``mtp.{k}.embed/head`` as copies, as ``state_dict()`` lists them
    state = load_file(folder / "model.safetensors")
    ours = model.state_dict()
    wrong = {k for k in state if k not in ours or ours[k].dtype != state[k].dtype} | (ours.keys() - state.keys())
    assert not wrong, f"fixture weights do not match the reference model: {sorted(wrong)}"
    model.load_state_dict(state, strict=True)
    hashes = model.engram_hash
    for name in ("token_map", "multipliers", "primes", "offsets"):
        assert torch.equal(getattr(hashes, name), engram[name]), name
    assert hashes.pad_id == engram["pad_id"].item()
    return model


def build_vl_model(ref: ModuleType, variant: str, max_seq_len: int) -> torch.nn.Module:
    """The reference model of a ``v41_tiny_vl`` variant (``dense`` / ``sparse``)."""
    config = json.loads((FIXTURE / variant / "config.json").read_text())
    return build_model(ref, config, FIXTURE, max_seq_len)


def _no_act_quant(
    x: torch.Tensor,
    block_size: int = 128,
    scale_fmt: str | None = None,
    scale_dtype: torch.dtype = torch.float32,
    inplace: bool = False,
) -> torch.Tensor:
    """``act_quant`` in noqdq mode. With bf16 weights every call is an in-place quantize-dequantize."""
    assert inplace, "only in-place QDQ is expected with bf16 weights"
    return x


def _no_fp4_act_quant(
    x: torch.Tensor, block_size: int = 32, inplace: bool = False, scale_dtype: torch.dtype = torch.float8_e8m0fnu
) -> torch.Tensor:
    """``fp4_act_quant`` in noqdq mode (in place only, as :func:`_no_act_quant`)."""
    assert inplace, "only in-place QDQ is expected with bf16 weights"
    return x


@contextlib.contextmanager
def quantization(ref: ModuleType, mode: str) -> Iterator[None]:
    """``qdq``: the reference as released; ``noqdq``: its activation QDQ steps replaced by identities."""
    if mode == "qdq":
        yield
        return
    with (
        mock.patch.object(ref, "act_quant", _no_act_quant),
        mock.patch.object(ref, "fp4_act_quant", _no_fp4_act_quant),
    ):
        yield


def numerics(native: bool) -> contextlib.AbstractContextManager:
    """Reference numerics, or the CPU's native products with only the ViT's fused attention computed as the
    fixtures' torch 2.14 CPU kernel does (``portable_attention``), which is how the shipped fixtures were made."""
    if native:
        return mock.patch("torch.nn.functional.scaled_dot_product_attention", portable_attention)
    return reference_numerics()


def capture_hooks(model: torch.nn.Module, captured: dict[str, torch.Tensor]) -> contextlib.ExitStack:
    """Records layer 0's attention input, window K=V and output (batch squeezed) and the ViT's and aligner's
    outputs into ``captured``, named as the fixtures' captures, while the returned stack is open."""
    stack = contextlib.ExitStack()

    def keep(key: str, value: torch.Tensor) -> None:
        captured[key] = value.clone()

    def hook(module: torch.nn.Module, key: str, batch: bool = False) -> None:
        handle = module.register_forward_hook(lambda m, args, out: keep(key, out[0] if batch else out))
        stack.callback(handle.remove)

    attn = model.layers[0].attn
    handle = attn.register_forward_pre_hook(lambda m, args: keep("layers.0.attn_in", args[0][0]))
    stack.callback(handle.remove)
    hook(attn, "layers.0.attn_out", batch=True)
    window_kv = attn._window_kv

    def recorded_window_kv(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        kv, idxs = window_kv(*args)
        keep("layers.0.window_kv", kv[0])
        return kv, idxs

    stack.enter_context(mock.patch.object(attn, "_window_kv", recorded_window_kv))
    hook(model.vision.patch_embed, "vision.patch_embed_out")
    for j, block in enumerate(model.vision.blocks):
        hook(block, f"vision.blocks.{j}.out")
    hook(model.vision, "vision.out")
    hook(model.aligner, "aligner.out")
    return stack


def reference_logits(
    ref: ModuleType,
    model: torch.nn.Module,
    prompt: Prompt,
    mode: str,
    native: bool,
    captures: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Full-position logits [S, vocab] fp32: the reference head returns only the last row, so the final normed
    hidden state is captured and the same ``head`` applied to every position. With ``captures``, also records
    what :func:`capture_hooks` names."""
    images = None
    if prompt.image is not None:
        start, patches, n_vit_h, n_vit_w = prompt.image
        types = prompt.token_types[0, start:][prompt.token_types[0, start:] >= 0]
        image_input = importlib.import_module(f"{PACKAGE}.image_processor").ImageInput
        images = [[image_input(start, patches, n_vit_h, n_vit_w, types)]]
    captured = {}
    hook = model.norm.register_forward_hook(lambda module, args, out: captured.__setitem__("normed", out))
    recording = capture_hooks(model, captures) if captures is not None else contextlib.nullcontext()
    try:
        with quantization(ref, mode), numerics(native), ref.set_dtype(torch.bfloat16), torch.inference_mode():
            with recording:
                _, last, _ = model(prompt.input_ids, 0, images=images, token_types=prompt.token_types)
            logits = model.head(captured["normed"], full_logits=True)[0]
    finally:
        hook.remove()
    assert torch.allclose(logits[-1], last[0], atol=1e-5), "full-position head disagrees with the model's last row"
    return logits


def prompts() -> dict[str, Prompt]:
    """The fixture's prompt (57 ids with the image at 20), and the ``text`` (200 ids) / ``image`` (150 ids, the
    fixture image at 90) prompts whose ids the golden files store."""
    fixture = load_file(FIXTURE / "inputs.safetensors")
    grid = json.loads((FIXTURE / "meta.json").read_text())["inputs"]
    image = fixture["pixel_values"], grid["n_vit_h"], grid["n_vit_w"]
    stored = [load_file(DATA / name) for name in GOLDENS]
    for key in ("text_input_ids", "image_input_ids", "image_token_types"):
        assert all(torch.equal(stored[0][key], golden[key]) for golden in stored), f"{key} differs between files"
    fixture_types, image_types = fixture["token_types"], stored[0]["image_token_types"]
    return {
        "fixture": Prompt(fixture["input_ids"], fixture_types, (_image_start(fixture_types), *image)),
        "text": Prompt(stored[0]["text_input_ids"], None, None),
        "image": Prompt(stored[0]["image_input_ids"], image_types, (_image_start(image_types), *image)),
    }


def _image_start(token_types: torch.Tensor) -> int:
    return int((token_types[0] >= 0).nonzero()[0])


def dspark_outputs(ref: ModuleType, mode: str, native: bool = False) -> dict[str, torch.Tensor]:
    """The DSpark fixture's README §2 protocol: prefill, ``forward_spec(out, mh, 0)`` seeding the rings, then one
    teacher-forced token and one draft call per step; then the full pass on a fresh model, its head applied to
    every position. Returns the keys of the fixture's ``expected_{mode}.safetensors``."""
    config = json.loads((DSPARK_FIXTURE / "config.json").read_text())
    inputs = load_file(DSPARK_FIXTURE / "inputs.safetensors")
    ids, prompt_len = inputs["input_ids"], int(inputs["prompt_len"])
    steps: dict[str, list[torch.Tensor]] = {}
    model = build_model(ref, config, DSPARK_FIXTURE, ids.shape[1])
    with quantization(ref, mode), numerics(native), ref.set_dtype(torch.bfloat16), torch.inference_mode():
        out, logits, main_hidden = model(ids[:, :prompt_len], 0)
        tensors = {"prefill_logits": logits, "prefill_output_ids": out, "prefill_main_hidden": main_hidden}
        assert model.forward_spec(out, main_hidden, 0) is None
        for t in range(prompt_len, ids.shape[1]):
            out, logits, main_hidden = model(ids[:, t : t + 1], t)
            draft_ids, draft_logits, confidence = model.forward_spec(out, main_hidden, t)
            for key, value in (
                ("logits", logits),
                ("output_ids", out),
                ("main_hidden", main_hidden),
                ("draft_output_ids", draft_ids),
                ("draft_logits", draft_logits),
                ("confidence", confidence),
            ):
                steps.setdefault(key, []).append(value)
    tensors |= {key: torch.stack(values) for key, values in steps.items()}
    model, captured = build_model(ref, config, DSPARK_FIXTURE, ids.shape[1]), {}
    model.norm.register_forward_hook(lambda module, args, normed: captured.__setitem__("normed", normed))
    with quantization(ref, mode), numerics(native), ref.set_dtype(torch.bfloat16), torch.inference_mode():
        _, last, main_hidden = model(ids, 0)
        full_logits = model.head(captured["normed"], full_logits=True)
    tensors |= {"full_logits": full_logits, "full_last_logits": last, "full_main_hidden": main_hidden}
    shipped = load_file(DSPARK_FIXTURE / f"expected_{mode}.safetensors")
    assert tensors.keys() == shipped.keys(), (sorted(tensors), sorted(shipped))
    for key, value in tensors.items():
        assert value.shape == shipped[key].shape and value.dtype == shipped[key].dtype, key
    return tensors


def convert_released(
    ref: ModuleType, ref_state: dict[str, torch.Tensor], stored: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The exported tensors as the reference's ``Transformer`` holds them, by the rules of DeepSeek's ``convert.py``
    that the reference states: a weight it holds unquantized is dequantized to its dtype (``Attention.forward``:
    "convert.py dequantizes [wo_a] to bf16"; with ``dtype="bf16"`` every Linear, as the fixtures were run), and the
    packed FP4 experts, two E2M1 codes a byte with the low nibble first (``kernel_cpu.unpack_fp4``, "same as
    upstream convert.py FP4_TABLE"), are read as ``float4_e2m1fn_x2``. The names are the release's, which are the
    reference's own (no renaming; one process, so nothing to shard). Dequantization is exact: an e4m3 or E2M1 value
    times a power of two is a bf16 value."""
    unpack_fp4 = importlib.import_module(f"{PACKAGE}.kernel_cpu").unpack_fp4
    quantized = (torch.float8_e4m3fn, torch.float4_e2m1fn_x2)
    out = {}
    for name, tensor in stored.items():
        held = ref_state.get(name)
        if name.endswith(".scale") and held is None:  # the scale of a weight the reference holds unquantized
            continue
        scale = stored.get(name[: -len(".weight")] + ".scale") if name.endswith(".weight") else None
        if scale is not None and held is not None and held.dtype not in quantized:
            rows, cols = held.shape
            if tensor.dtype == torch.int8:  # FP4 routed expert: one E8M0 scale per row and 32 columns
                values, scales = unpack_fp4(tensor), scale.float().repeat_interleave(32, 1)
            else:  # FP8 Linear: one E8M0 scale per 32x32 block
                values, scales = tensor.float(), scale.float().repeat_interleave(32, 0).repeat_interleave(32, 1)
            tensor = (values * scales[:rows, :cols]).to(held.dtype)
        elif held is not None and held.dtype == torch.float4_e2m1fn_x2 and tensor.dtype == torch.int8:
            tensor = tensor.view(torch.float4_e2m1fn_x2)
        out[name] = tensor
    return out


def load_released(ref: ModuleType, folder: Path, max_seq_len: int, dtype: str) -> torch.nn.Module:
    """The reference ``Transformer`` of an exported folder, built as DeepSeek's ``generate.py`` builds it:
    ``ModelArgs(**inference/config.json)`` (with batch 1, ``max_seq_len`` and greedy sampling as the runtime
    limits; ``dtype="bf16"`` also sets ``dtype="bf16", expert_dtype=None``, the fixtures' build), the tokenizer from
    the folder's ``tokenizer.json`` (the Engram token map), bf16 default dtype, and the shards of
    ``model.safetensors.index.json`` through :func:`convert_released`, loaded strictly with every name, shape and dtype
    checked."""
    from transformers import PreTrainedTokenizerFast

    config = json.loads((folder / "inference" / "config.json").read_text())
    config |= {"max_batch_size": 1, "max_seq_len": max_seq_len, "temperature": 0.0}
    if dtype == "bf16":
        config |= {"dtype": "bf16", "expert_dtype": None}
    args = ref.ModelArgs(**config)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    with ref.set_dtype(torch.bfloat16):
        model = ref.Transformer(args, tokenizer).eval()
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    stored = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(folder / shard, "pt") as f:
            stored |= {name: f.get_tensor(name) for name in f.keys()}
    assert stored.keys() == index["weight_map"].keys(), "the index does not list the shards' tensors"
    ours = model.state_dict()
    state = convert_released(ref, ours, stored)
    wrong = {k for k in state if k not in ours or ours[k].dtype != state[k].dtype or ours[k].shape != state[k].shape}
    assert not wrong and ours.keys() == state.keys(), (sorted(wrong), sorted(ours.keys() ^ state.keys()))
    model.load_state_dict(state, strict=True)
    return model


def greedy_decode(model: torch.nn.Module, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's greedy decode of ``EXPORT_NEW_TOKENS`` ids after ``prompt`` (prefill at 0, then one id a
    step at its position): the ids [EXPORT_NEW_TOKENS] and the logits [EXPORT_NEW_TOKENS, vocab] fp32 they are the
    argmax of."""
    ids, logits = [], []
    out, last, _ = model(prompt, 0)
    for step in range(EXPORT_NEW_TOKENS):
        assert torch.equal(out, last.argmax(-1)), "greedy sampling picked another id than the argmax"
        ids.append(out)
        logits.append(last[0])
        if step + 1 < EXPORT_NEW_TOKENS:
            out, last, _ = model(out[:, None], prompt.shape[1] + step)
    return torch.cat(ids), torch.stack(logits)


def export_outputs(ref: ModuleType) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The released export of the seeded fine-tune (``reference_fixture.released_finetune``), loaded by the reference
    (:func:`load_released`) and decoded greedily from ``export_prompt()``, twice: ``bf16`` (the reference built as
    the fixtures were, every weight dequantized by the convert step) and ``fp8`` (as released: FP8 Linears and FP4
    experts through ``fp8_gemm`` / ``fp4_gemm``, which quantize their inputs to FP8). Both as released otherwise
    (window KV, compressed KV and indexer QDQ), in the mode. Returns the prompt, ``{bf16,fp8}_output_ids`` and
    ``{bf16,fp8}_logits``, and the sha256 of the files the reference read."""
    prompt = export_prompt()
    tensors = {"prompt_ids": prompt}
    with tempfile.TemporaryDirectory() as tmp:
        folder = released_finetune(FIXTURE.parent, Path(tmp))
        hashes = export_read_files(folder)
        for dtype in ("bf16", "fp8"):
            model = load_released(ref, folder, prompt.shape[1] + EXPORT_NEW_TOKENS, dtype)
            with reference_numerics(), ref.set_dtype(torch.bfloat16), torch.inference_mode():
                tensors[f"{dtype}_output_ids"], tensors[f"{dtype}_logits"] = greedy_decode(model, prompt)
        assert export_read_files(folder) == hashes
    return tensors, hashes


def same_bits(label: str, ours: torch.Tensor, expected: torch.Tensor) -> bool:
    """Prints max|Δ| of two tensors and whether they hold the same bits; returns the latter."""
    same = ours.shape == expected.shape and ours.dtype == expected.dtype
    same = same and torch.equal(ours.view(torch.uint8), expected.view(torch.uint8))
    delta = (ours.float() - expected.float()).abs().max().item()
    print(f"{label}: max|Δ| {delta:.3g} ({'same bits' if same else 'DIFFERENT BITS'})")
    return same


def write_or_check(
    name: str, tensors: dict[str, torch.Tensor], check: bool, metadata: dict[str, str] | None = None
) -> bool:
    """Writes ``tensors`` (and ``metadata``) to ``tests/data/{name}``, or compares them bit for bit (and the metadata
    for equality) with the committed file."""
    if not check:
        save_file(tensors, DATA / name, metadata=metadata)
        print(f"wrote {DATA / name}")
        return True
    committed, ok = load_file(DATA / name), True
    with safe_open(DATA / name, "pt") as f:
        same_metadata = (f.metadata() or None) == metadata
    print(f"{name} metadata: {'same' if same_metadata else 'DIFFERENT'}")
    ok &= same_metadata
    assert committed.keys() == tensors.keys(), (sorted(committed), sorted(tensors))
    for key in sorted(tensors):
        ok &= same_bits(f"{name} {key}", tensors[key], committed[key])
    return ok


def make_goldens(ref: ModuleType, check: bool) -> bool:
    """Computes every tensor of the golden files; writes them, or compares them with the committed ones."""
    inputs = prompts()
    longest = max(p.input_ids.shape[1] for p in inputs.values())
    ok = True
    for name, (mode, names) in GOLDENS.items():
        tensors = {}
        for prompt in names:
            if prompt != "fixture":
                tensors[f"{prompt}_input_ids"] = inputs[prompt].input_ids
        if "image" in names:
            tensors["image_token_types"] = inputs["image"].token_types
        for variant in VARIANTS:
            for prompt in names:
                model = build_vl_model(ref, variant, longest)
                captures = {} if (variant, prompt) == CAPTURED else None
                tensors[f"{variant}_{prompt}_logits"] = reference_logits(
                    ref, model, inputs[prompt], mode, native=False, captures=captures
                )
                tensors.update({f"{variant}_{prompt}_{key}": value for key, value in (captures or {}).items()})
        ok &= write_or_check(name, tensors, check)
    for name, mode in DSPARK_GOLDENS.items():
        ok &= write_or_check(name, dspark_outputs(ref, mode), check)
    tensors, hashes = export_outputs(ref)
    ok &= write_or_check(EXPORT_GOLDEN, tensors, check, {"sha256": json.dumps(hashes, sort_keys=True)})
    return ok


def compare_with_shipped_fixtures(ref: ModuleType) -> bool:
    """The fixture prompt with native products vs the shipped ``expected_{qdq,noqdq}`` logits, and the DSpark
    protocol's outputs vs the DSpark fixture's."""
    prompt, ok = prompts()["fixture"], True
    for variant in VARIANTS:
        for mode in ("noqdq", "qdq"):
            model = build_vl_model(ref, variant, prompt.input_ids.shape[1])
            logits = reference_logits(ref, model, prompt, mode, native=True)
            shipped = load_file(FIXTURE / variant / f"expected_{mode}.safetensors")["logits"]
            ok &= same_bits(f"{variant}/expected_{mode} logits", logits, shipped)
    for mode in ("noqdq", "qdq"):
        shipped = load_file(DSPARK_FIXTURE / f"expected_{mode}.safetensors")
        for key, value in sorted(dspark_outputs(ref, mode, native=True).items()):
            ok &= same_bits(f"v41_tiny_dspark/expected_{mode} {key}", value, shipped[key])
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", type=Path, required=True, help="folder holding the reference's sources")
    parser.add_argument("--check", action="store_true", help="compare with the committed files instead of writing")
    parser.add_argument("--native", action="store_true", help="native products, compared with the shipped fixtures")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (CI runs 2)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ref = import_reference(args.reference.resolve())
    began = time.perf_counter()
    ok = compare_with_shipped_fixtures(ref) if args.native else make_goldens(ref, args.check)
    print(f"torch {torch.__version__}, {args.threads} threads, {time.perf_counter() - began:.1f} s")
    if (args.check or args.native) and not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
