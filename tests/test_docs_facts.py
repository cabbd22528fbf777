"""What README and the docs pages state about the code holds.

- The parameter counts, memory and per-rank figures given for the released model are what ``dsv41 inspect`` prints
  (run here on the meta device): each sentence is checked with the numbers read from the inspector's output, so a
  change of the model, the planner or the parallel plans shows up here until the docs say the new figures.
- Every folder the pages' commands and snippets write is ignored by git.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
from functools import lru_cache

import pytest
from documentation import DOCS, REPO_ROOT, code_blocks, pages

from configuration import DeepseekV41Config
from modeling_dsv41.cli import main
from modeling_dsv41.training.activation_memory import layer_saved_bytes_per_token

RELEASED = DOCS / "released-model.md"
README = REPO_ROOT / "README.md"


@lru_cache
def inspect(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["inspect", *argv]) == 0
    return out.getvalue()


def read(output: str, pattern: str) -> tuple[str, ...]:
    match = re.search(pattern, output, re.MULTILINE)
    assert match, f"{pattern!r} not in the output:\n{output}"
    return match.groups()


def prose(page) -> str:
    """The page's text with every run of whitespace one space (sentences wrap anywhere)."""
    return " ".join(page.read_text().split())


def billions(component: str) -> str:
    (count,) = read(inspect(), rf"^{re.escape(component)}\s+([\d,]+)\s")
    return f"{int(count.replace(',', '')) / 1e9:.1f}"


def total_billions() -> str:
    return read(inspect(), r"^Parameters: [\d,]+ \((\d+)B\)")[0]


def assert_says(page, sentence: str) -> None:
    assert sentence in prose(page), f"{page.name} should say: {sentence}"


def test_parameter_counts():
    total, engram, experts, head = (
        total_billions(),
        billions("Engram: tables"),
        billions("MoE: routed experts"),
        billions("DSpark draft head"),
    )
    (state,) = read(inspect(), r"\((\d+)% of AdamW\)")
    assert_says(
        RELEASED, f"The model has {total} billion parameters, the {head}-billion-parameter DSpark draft head included"
    )
    assert_says(RELEASED, f"{engram}-billion-parameter Engram tables")
    assert_says(
        RELEASED,
        f"{total} billion parameters, of which {engram} billion are the two Engram tables, {experts} "
        f"billion the routed experts and {head} billion the DSpark draft head; `MixedOptimizer` keeps "
        f"{state}% of AdamW's state",
    )
    assert_says(DOCS / "design.md", f"the two tables hold {engram} billion parameters")


def test_native_and_bf16_weights():
    native = read(inspect("--devices", "8x141GiB"), r"^weights in all: ([\d.]+ [GT]iB) \(")[0]
    loaded = read(inspect("--storage", "loaded", "--devices", "8x141GiB"), r"^weights in all: ([\d.]+ [GT]iB) \(")[0]
    assert_says(RELEASED, f"its weights take {native} natively")
    assert_says(RELEASED, f"against {loaded} loaded in bf16")
    small = inspect("--devices", "8x80GiB")
    (host,) = read(small, r"host memory for Engram: ([\d.]+ GiB)")
    assert read(small, r"^weights in all: ([\d.]+ [GT]iB) \(")[0] == native
    assert "all weights on accelerators" in small and "all weights on accelerators" in inspect("--devices", "8x141GiB")
    assert_says(
        RELEASED,
        f"The released model takes {native} natively: it fits 8×141 GiB with the tables on the "
        f"accelerators, and 8×80 GiB with the two tables ({host}) in host memory",
    )


def test_bitsandbytes_storage_table():
    out = inspect("--storage", "nf4")
    for path in (
        "bf16 (fp32 where kept)",
        "native FP8 / FP4 (released storage)",
        "bitsandbytes int8",
        "bitsandbytes NF4",
        "bitsandbytes NF4, double quantization",
    ):
        cells = read(out, rf"^{re.escape(path)}\s+([\d.]+ [GT]iB)\s+([\d.]+)\s+([\d.]+ [GT]iB)\s+([\d.]+)$")
        assert_says(RELEASED, f"| {path} | {' | '.join(cells)} |")
    (without,) = read(out, r"^bitsandbytes NF4, double quantization\s+\S+ \S+\s+\S+\s+\S+ \S+\s+([\d.]+)$")
    assert_says(RELEASED, f"NF4 with double quantization holds everything but the Engram tables in {without} bytes")


@pytest.mark.parametrize("plan", ["--tp", "--ep"])
def test_per_rank_weights_under_tensor_and_expert_parallelism(plan):
    output = inspect("--devices", "8x141GiB", plan, "8")
    per_rank, share = read(output, r"^weights per rank\s+([\d.]+ GiB) of 141.0 GiB \((\d+)%\)")

    def row(component: str, held: str) -> str:
        return read(output, rf"^{re.escape(component)}\s+([\d.]+ [GMK]iB)\s+{held}$")[0]

    (tables,) = read(output, r"^Engram tables: ([\d.]+ GiB)")
    assert_says(
        RELEASED,
        f"plans: {per_rank} of weights per rank ({share}% of an H200's 141 GiB), of which "
        f"{row('MoE: routed experts', 'its part')} are its part of the routed experts, "
        f"{row('DSpark draft head', 'its part')} its part of the DSpark draft head (its experts and "
        f"shared experts follow the backbone's plans) and {row('DSpark draft head', 'whole')} the rest "
        f"of the head, and {row('attention', 'whole')} the attention, both held whole by every rank; "
        f"plus the {tables} of Engram tables in host memory",
    )


def docs_lora_table() -> dict[str, list[str]]:
    """docs/released-model.md's LoRA table: each row's label → its cells (resident, activations offloaded, all
    offloaded)."""
    text = RELEASED.read_text()
    lines = text[text.index("| 8 devices, 4096 tokens, rank 16 |") :].split("\n\n")[0].splitlines()[2:]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    return {row[0]: row[1:] for row in rows}


def longest(output: str) -> tuple[str, ...]:
    return read(output, r"^longest sequence per device that fits" + r"\s+(\d+) tokens" * 3 + "$")


def test_lora_plan_table_and_figures():
    output = inspect("--devices", "8x80GiB", "--train", "lora")
    table = output[re.search(r"^per device\s+resident", output, re.MULTILINE).start() :].splitlines()[1:]
    planned = [
        figures
        for line in table[: next(i for i, line in enumerate(table) if line.startswith("total")) + 1]
        if (figures := re.findall(r"[\d.]+ GiB|host", line))
    ]  # the rows with a figure, through the total
    documented = docs_lora_table()
    assert [
        [re.search(r"[\d.]+ GiB|host", cell).group() for cell in cells]
        for cells in list(documented.values())[: len(planned)]
    ] == planned
    verdicts = read(output, r"^on 80\.0 GiB devices" + r"\s+(does not fit|fits)" * 3 + "$")
    assert [cell.replace("*", "").split(",")[0] for cell in documented["on 8×80 GiB"]] == list(verdicts)
    assert documented["longest sequence per device, 8×80 GiB"] == list(longest(output))
    wide = inspect("--devices", "8x141GiB", "--train", "lora")
    assert documented["longest sequence per device, 8×141 GiB"] == list(longest(wide))
    (unit,) = read(output, r"^largest unit gathered: (\S+)")
    assert f"| gathered units (`{unit}` + prefetch) |" in RELEASED.read_text()
    (adapters,) = read(output, r"rank 16, .*: ([\d.]+B) adapter parameters\)")
    (tables,) = read(output, r"^host memory, Engram tables: ([\d.]+ GiB)")
    (inputs,) = read(output, r"^host memory, checkpointed layer inputs \(this rank\): ([\d.]+ GiB)")
    (offloaded,) = read(output, r"^host memory, frozen shards and adapter state \(all ranks\): ([\d.]+ GiB)")
    assert documented["checkpointed layer inputs"][1:] == [f"host ({inputs})"] * 2
    assert_says(DOCS / "training.md", f"copied once): {inputs} per device for the released model at 4096 tokens")
    assert_says(RELEASED, f"The Engram tables stay in host memory ({tables})")
    assert_says(RELEASED, f"For the released model at rank 16 ({adapters} adapter parameters)")
    assert_says(RELEASED, f"All offloaded puts {offloaded} of frozen shards and adapter state in host memory")
    loss, worst, layer = read(
        output,
        r"^activations \(resident\) peak at the loss: ([\d.]+) GiB; at layer (\d+)'s "
        r"backward, .*: ([\d.]+) GiB$",
    )
    moved_loss, moved_worst, moved_layer = read(
        output,
        r"^activations \(activations offloaded, all offloaded\) peak at the loss: ([\d.]+) GiB; at layer "
        r"(\d+)'s backward, .*: ([\d.]+) GiB$",
    )
    assert_says(
        RELEASED,
        f"The worst layer's backward (layer {worst} with every input still held, layer {moved_worst} "
        f"when they are offloaded) holds {layer} GiB and {moved_layer} GiB of activations, below the "
        f"loss's {loss} and {moved_loss}",
    )
    text = DeepseekV41Config.from_preset("deepseek-v4.1-flash").text_config
    saved = max(layer_saved_bytes_per_token(text, i, 4096) for i in range(text.num_hidden_layers))  # per token
    assert_says(
        RELEASED,
        f"For the released model at 4096 tokens it saves {saved * 4096 / 2**30:.1f} GiB "
        f"({saved / 1e6:.1f} MB per token",
    )
    resident, activations_offloaded, _ = longest(wide)
    assert_says(
        RELEASED,
        f"On 8×141 GiB the released model trains on {resident}-token sequences with everything "
        f"resident and {activations_offloaded} with the activations offloaded",
    )


def test_lora_plan_with_expert_parallelism():
    """The page's comparison of the launch with --expert_parallel_size 8 against FSDP2 alone, from the planner."""

    def figures(output: str) -> tuple[str, ...]:
        (gathered,) = read(output, r"^gathered units \(one \+ prefetch\)\s+([\d.]+ GiB)")
        (total,) = read(output, r"^total\s+([\d.]+ GiB)")
        return gathered, total, longest(output)[0]

    alone, split = (
        inspect("--devices", "8x80GiB", "--train", "lora"),
        inspect("--devices", "8x80GiB", "--train", "lora", "--ep", "8"),
    )
    (buffers,) = read(split, r"^all-to-all buffers \(routed slots\)\s+([\d.]+ GiB)")
    (gathered, total, tokens), (gathered_alone, total_alone, tokens_alone) = figures(split), figures(alone)
    assert_says(
        RELEASED,
        f"`dsv41 inspect --devices 8x80GiB --train lora --ep 8` plans it, the gathered units "
        f"{gathered} instead of {gathered_alone}, the all-to-all buffers of the routed slots {buffers} "
        f"more, {total} per device instead of {total_alone} with everything resident, and the longest "
        f"sequence per device that fits {tokens} tokens instead of {tokens_alone}.",
    )


def test_readme_lora_figures():
    """README's summary of the plan: the released model's LoRA at rank 16 and 4096 tokens per device."""
    output = inspect("--devices", "8x80GiB", "--train", "lora")
    totals = read(output, r"^total" + r"\s+([\d.]+ GiB)" * 3 + "$")
    narrow, wide = longest(output), longest(inspect("--devices", "8x141GiB", "--train", "lora"))
    assert read(output, r"^on 80\.0 GiB devices\s+(fits)\s+fits\s+fits$")  # the goal: resident on 8×80 GiB
    assert_says(
        README,
        f"4096-token sequence per device: {totals[0]} per device with everything, the weights included, "
        f"on the devices: it fits 8×80 GiB ({totals[1]} with the checkpointed layer inputs in host memory)",
    )
    assert_says(
        README,
        f"The longest sequence per device is {narrow[0]} tokens on 8×80 GiB and {wide[0]} on 8×141 GiB "
        f"with everything resident, {narrow[1]} and {wide[1]} with those inputs offloaded",
    )


def written_folders() -> set[str]:
    """The top folder of every output the pages' Python snippets and bash commands write (relative paths)."""
    folders = set()
    for page in pages():
        for code in code_blocks(page, "python"):
            folders |= set(re.findall(r'output_dir="([^"/]+)', code))
            folders |= set(re.findall(r'save_pretrained\("([^"/]+)', code))
            folders |= set(re.findall(r'export_for_hub\(\s*\w+, "([^"/]+)', code))
        for code in code_blocks(page, "bash"):
            for line in code.splitlines():
                argv = shlex.split(line, comments=True)
                folders |= {
                    argv[i + 1].split("/")[0] for i, arg in enumerate(argv[:-1]) if arg in ("--output_dir", "--output")
                }
                for i, arg in enumerate(argv[:-1]):  # the dsv41 command, as `dsv41` or `.venv/bin/dsv41`
                    if arg.split("/")[-1] == "dsv41" and argv[i + 1] == "convert":
                        folders.add(argv[i + 3].split("/")[0])
                    if arg.split("/")[-1] == "dsv41" and argv[i + 1] == "demo" and "--output" not in argv:
                        folders.add("dsv41-demo")  # its default output
    return folders


def test_every_folder_the_docs_write_is_ignored_by_git():
    folders = written_folders()
    assert {"dsv41-demo", "dsv41-sft", "dsv41-fsdp2", "dsv41-lora", "converted"} <= folders, folders
    for folder in sorted(folders):
        result = subprocess.run(["git", "check-ignore", "--no-index", "-q", f"{folder}/"], cwd=REPO_ROOT)
        assert result.returncode == 0, f"{folder}/ (written by a documented command) is not in .gitignore"
