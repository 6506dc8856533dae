"""The options several commands share, each declared once here.

A group of options (the model and its import switches, the schedule, the mesh) reaches its
command as one frozen object (ModelArgs, ScheduleArgs, ParallelArgs) instead of a dozen
keyword arguments, so a command's signature names what is its own. The single options that
recur (--target, --input, --seed, -o, --sanitize) are factories taking what differs between
the commands (choices, default, help), so each command's help text stays its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click

from flowc.ir.types import MAX_MESH_DEVICES, MAX_MICROBATCHES
from flowc.options import (  # noqa: F401  (the records and parsers commands import from here)
    MAX_BYTES,
    ModelArgs,
    ParallelArgs,
    ScheduleArgs,
    TrainArgs,
    parse_bytes,
    parse_dim_values,
    parse_dims,
    parse_shapes,
)

F = TypeVar("F", bound=Callable[..., Any])
Decorator = Callable[[F], F]

# The most branch-and-bound nodes --search-nodes may give: HiGHS counts them in a C int.
MAX_SEARCH_NODES = (1 << 31) - 1


# -- help in groups ----------------------------------------------------------------------------

# The group each option is listed under in `--help` of compile, verify, eval and inspect
# (by the option's parameter name); an option not listed goes under "Other".
HELP_GROUPS: dict[str, tuple[str, ...]] = {
    "Input": ("shapes", "dims", "bounds", "weights", "inputs", "seed", "random_inputs"),
    "Training": (
        "train",
        "loss",
        "optimizer",
        "data",
        "steps",
        "batch",
        "accumulate",
        "no_shuffle",
        "lr_schedule",
        "clip_norm",
        "freeze",
        "no_decay",
        "untie",
        "ignore_index",
        "label_smoothing",
        "recompute",
        "skip_nonfinite",
        "checkpoint_dir",
        "save_every",
        "resume",
    ),
    "Precision": ("precision", "tol"),
    "Parallel": (
        "mesh",
        "parallel",
        "sbps",
        "cost_profile",
        "search_nodes",
        "zero",
        "pipeline",
        "microbatches",
        "stage_boundary",
        "pipeline_schedule",
    ),
    "Schedule": ("streams", "no_cuda_graph"),
    "Memory": ("schedule_for", "mem_limit"),
    "Output": (
        "project",
        "out_dir",
        "output",
        "target",
        "arch",
        "prefix",
        "force",
        "export",
        "log",
    ),
    "Debugging": ("print_times", "dump_after"),
}


class GroupedCommand(click.Command):
    """A command whose --help lists its options in HELP_GROUPS' groups, in that order, and
    ends with the example lines given as ``examples``."""

    def __init__(self, *args: Any, examples: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.examples = tuple(examples)

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        group_of = {name: group for group, names in HELP_GROUPS.items() for name in names}
        listed: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            if isinstance(param, click.Argument):
                continue  # MODEL is in the usage line and the description
            record = param.get_help_record(ctx)
            if record is not None:
                listed.setdefault(group_of.get(param.name or "", "Other"), []).append(record)
        for group in (*HELP_GROUPS, "Other"):
            if group in listed:
                with formatter.section(f"{group} options"):
                    formatter.write_dl(listed[group])

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        if self.examples:
            with formatter.section("Examples"):
                for line in self.examples:  # whole, never wrapped: to copy and paste
                    formatter.write(" " * formatter.current_indent + line + "\n")
        super().format_epilog(ctx, formatter)


# -- kinds of option ---------------------------------------------------------------------------
# Constructors for the kinds that recur, so each option below is one line of what is its own.


def text_option(
    name: str, metavar: str, help: str, dest: str | None = None, multiple: bool = False
) -> Decorator[Any]:
    """A string option (or, ``multiple``, a repeatable one) read by the command itself."""
    decls = [name] if dest is None else [name, dest]
    return click.option(*decls, metavar=metavar, multiple=multiple, help=help)


def flag_option(name: str, help: str, dest: str | None = None) -> Decorator[Any]:
    """An on/off switch, off unless given."""
    decls = [name] if dest is None else [name, dest]
    return click.option(*decls, is_flag=True, help=help)


def count_option(
    name: str,
    metavar: str,
    help: str,
    *,
    low: int,
    high: int | None = None,
    default: int | None = None,
) -> Decorator[Any]:
    """A whole number from ``low`` (to ``high``); click refuses others with the range."""
    return click.option(
        name,
        type=click.IntRange(min=low, max=high),
        default=default,
        show_default=default is not None,
        metavar=metavar,
        help=help,
    )


def choice_option(
    name: str, choices: Sequence[str], help: str | None, default: str | None = None
) -> Decorator[Any]:
    """One of ``choices``; a default is shown in the help."""
    return click.option(
        name,
        type=click.Choice(list(choices)),
        default=default,
        show_default=default is not None,
        help=help,
    )


def path_option(
    *decls: str, help: str, metavar: str | None = None, directory: bool = False
) -> Decorator[Any]:
    """A file (or, ``directory``, a folder) to read or write; None when not given."""
    kind = click.Path(file_okay=not directory, dir_okay=directory, path_type=Path)
    return click.option(*decls, type=kind, metavar=metavar, help=help)


def _with_options(
    fn: F,
    dest: str,
    cls: type[Any],
    options: Sequence[Decorator[Any]],
    unset: Sequence[str] = (),
) -> F:
    """``fn`` taking ``options`` (in the order the help lists them) as one ``cls`` object
    named ``dest``: each option's value is the field of its name; the fields in ``unset``
    have no option in the group and keep their defaults. functools.wraps keeps the
    docstring (the command's help) and the options declared below this group."""
    names = tuple(n for n in cls.__dataclass_fields__ if n not in unset)

    @functools.wraps(fn)
    def command(*args: Any, **kwargs: Any) -> Any:
        group = cls(**{n: kwargs.pop(n) for n in names})
        return fn(*args, **kwargs, **{dest: group})

    wrapped: Any = command
    for option in reversed(options):  # click lists the last decorator applied first
        wrapped = option(wrapped)
    return wrapped


# -- option groups -----------------------------------------------------------------------------


def model_options(fn: F) -> F:
    """MODEL, --shape, --dim, --print-pass-times, --dump-ir-after, --weights -> ``model``."""
    model = click.argument("path", metavar="MODEL", type=click.Path(dir_okay=False, path_type=Path))
    weights = click.option(
        "--weights",
        type=click.Path(dir_okay=False),
        help="Weights (.npz or .safetensors) for a .flow program's load(...) params.",
    )
    return _with_options(
        fn,
        "model",
        ModelArgs,
        [
            model,
            text_option(
                "--shape",
                "NAME=DIMS",
                "Whole shape of an input, e.g. x=1x3x224x224; a dim the model names may be a "
                "range, x=1..8x3x224x224.",
                dest="shapes",
                multiple=True,
            ),
            text_option(
                "--dim",
                "SYMBOL=N",
                "Value of a symbolic dimension, or its range LO..HI[@TYPICAL]: one program for "
                "every size in it (docs/dynamic.md).",
                dest="dims",
                multiple=True,
            ),
            text_option(
                "--bound",
                "OUTPUT=K",
                "Rows a data-dependent output (NonZero, NonMaxSuppression, Compress, TopK with "
                "a k of run time) holds at most: its buffer's size (docs/dynamic.md).",
                dest="bounds",
                multiple=True,
            ),
            flag_option(
                "--print-pass-times", "Print how long each pass took (to stderr).", "print_times"
            ),
            text_option(
                "--dump-ir-after",
                "PASS",
                "Print the IR after this pass (to stderr); repeatable.",
                dest="dump_after",
                multiple=True,
            ),
            weights,
        ],
    )


def schedule_options(fn: F) -> F:
    """--streams, --schedule-for, --no-cuda-graph, --precision -> ``schedule``."""
    return _with_options(
        fn,
        "schedule",
        ScheduleArgs,
        [
            count_option(
                "--streams",
                "N",
                "Compute streams per device for independent branches (default: as many as "
                "the schedule's simulation finds worth their events, at most 4).",
                low=1,
                high=32,
            ),
            choice_option(
                "--schedule-for",
                ["latency", "memory"],
                "latency: order and overlap the nodes for the modeled run time; memory: run "
                "them in the order of least peak memory (exact search where it is small "
                "enough), on one compute stream unless --streams asks for more. docs/memory.md.",
                default="latency",
            ),
            flag_option(
                "--no-cuda-graph",
                "Launch the schedule's kernels directly in every run() instead of replaying "
                "one CUDA Graph of it (a mesh's programs always launch directly).",
            ),
            choice_option(
                "--precision",
                ["fp32", "tf32", "bf16", "fp16"],
                "fp32: exact float32 GEMMs and convolutions; tf32: those on tensor cores with "
                "TF32 inputs; bf16/fp16: weights and activations stored narrow, GEMMs and "
                "convolutions on tensor cores accumulating in float32, softmax, norms and "
                "reductions in float32 (inputs and outputs stay float32). docs/performance.md.",
                default="fp32",
            ),
        ],
    )


def parallel_options(fn: F) -> F:
    """--mesh, --parallel, --sbp, --mem-limit, --cost-profile, --search-nodes, --zero,
    --pipeline, --microbatches, --stage-boundary -> ``parallel``."""
    return _with_options(
        fn,
        "parallel",
        ParallelArgs,
        [
            text_option(
                "--mesh",
                "N|AxB",
                "Devices to run on: 4, or 2x4 for a 2-D mesh (one MPI rank per device).",
            ),
            choice_option(
                "--parallel",
                ["auto", "data", "none"],
                "auto: searched; data: inputs split on batch, parameters whole; none: all whole.",
                default="auto",
            ),
            text_option(
                "--sbp",
                "NAME=SBP",
                "Fix the layout of an input, parameter or value: x=S(0), w=(B,S(1)), x=S0.",
                dest="sbps",
                multiple=True,
            ),
            text_option(
                "--mem-limit", "BYTES", "Per-device bytes for parameters + arena, e.g. 64MiB."
            ),
            path_option(
                "--cost-profile",
                help="Device and link rates for the search (TOML; default: H200 with NVLink).",
            ),
            count_option(
                "--search-nodes",
                "N",
                "Branch-and-bound nodes the placement search may use (a work limit: the same "
                "plan on any machine; default 2000).",
                low=0,
                high=MAX_SEARCH_NODES,
            ),
            count_option(
                "--zero",
                "K",
                "With --train: ZeRO stage K (1, 2: each parameter's optimizer state split on "
                "axis 0 over the mesh; 3: the parameters too).",
                low=1,
                high=3,
            ),
            count_option(
                "--pipeline",
                "P",
                "Pipeline parallelism: P stages on mesh axis 0 (--mesh P: a device per stage; "
                "--mesh PxK: K per stage); the cuts come from --stage-boundary, the program's "
                "stage blocks, or the partition balancing the stages.",
                low=1,
                high=MAX_MESH_DEVICES,
            ),
            count_option(
                "--microbatches",
                "M",
                "With --pipeline: split the batch (axis 0) into M micro-batches that stream "
                "through the stages.",
                low=1,
                high=MAX_MICROBATCHES,
                default=1,
            ),
            text_option(
                "--stage-boundary",
                "VALUE,...",
                "With --pipeline P: the last value of each stage but the last (P-1 names), "
                "instead of the automatic partition.",
            ),
            choice_option(
                "--pipeline-schedule",
                ["1f1b", "gpipe"],
                "With --pipeline: the micro-batches' order on the stages. A training step "
                "runs it (default 1f1b); inspect --schedule simulates it on the stages' "
                "modeled forward times (1f1b with backward actors at 2x the forward time).",
            ),
        ],
    )


def training_options(fn: F) -> F:
    """--loss, --optimizer, --batch, --accumulate, --lr-schedule, --clip-norm, --freeze, --no-decay,
    --ignore-index, --label-smoothing, --recompute -> ``training`` (`flowc train`, `flowc compile
    --train`)."""
    return _with_options(
        fn,
        "training",
        TrainArgs,
        [
            text_option(
                "--loss",
                "KIND:PRED[,TARGET]",
                "cross_entropy:LOGITS,LABELS (class axis last, integer labels), "
                "mse:PRED,TARGET, l1:..., bce_with_logits:..., or output:VALUE (a scalar of "
                "the model is the loss). PRED names any value of the model; TARGET becomes a "
                "new input of the step.",
            ),
            text_option(
                "--optimizer",
                "KIND:k=v,...",
                "sgd:lr=..,momentum=..,dampening=..,nesterov=..,weight_decay=.. | "
                "adam:lr=..,beta1=..,beta2=..,eps=..,weight_decay=.. | adamw:... (PyTorch's "
                "defaults for what is not given; lr is required).",
            ),
            count_option(
                "--batch", "B", "Examples per step (binds axis 0 of every model input).", low=1
            ),
            click.option(
                "--accumulate",
                type=click.IntRange(1, 4096),
                default=1,
                metavar="K",
                help="Accumulate the gradients of K micro-batches of B examples (each forward "
                "and backward in turn) into one update; the loss is normalized by all their "
                "labels. A step takes K*B rows.",
            ),
            text_option(
                "--lr-schedule",
                "KIND:k=v,...",
                "constant[:warmup=W] | cosine:warmup=W,total=T,min_lr=F | linear:... (the rate "
                "of step t, from 1, computed in the step).",
            ),
            click.option(
                "--clip-norm",
                type=float,
                default=None,
                metavar="X",
                help="Clip the gradients' global norm to X.",
            ),
            text_option(
                "--freeze", "REGEX", "Parameters (initializers) whose names match stay as they are."
            ),
            text_option("--no-decay", "REGEX", "Parameters whose names match get no weight decay."),
            text_option(
                "--untie",
                "REGEX",
                "Shared initializers (ties, an exporter's deduplication) whose names match get "
                "a copy per use, trained apart (NAME#1, ...; export writes the first).",
            ),
            click.option(
                "--ignore-index",
                type=int,
                default=None,
                metavar="I",
                help="cross_entropy: labels equal to I count for nothing.",
            ),
            click.option(
                "--label-smoothing",
                type=float,
                default=0.0,
                metavar="E",
                help="cross_entropy: smooth the targets by E.",
            ),
            click.option(
                "--recompute",
                type=click.Choice(["none", "auto", "all"]),
                default="none",
                help="Activations the backward computes again instead of keeping them: none; "
                "all (every segment between the forward's narrow points); auto (the least "
                "extra FLOPs that fit --mem-limit). The results are the same.",
            ),
        ],
        # --mem-limit is the command's own (flowc train) or the Memory group's.
        unset=("mem_limit",),
    )


# -- single options that several commands take -------------------------------------------------


def target_option(
    choices: Sequence[str], help: str | None, default: str | None = None
) -> Decorator[Any]:
    """--target, with the command's own choices, default and help."""
    return choice_option("--target", choices, help, default)


def input_option(help: str = "An input array.") -> Decorator[Any]:
    """--input NAME=PATH.npy, repeatable -> ``inputs``."""
    return text_option("--input", "NAME=PATH.npy", help, dest="inputs", multiple=True)


def seed_option(help: str) -> Decorator[Any]:
    """--seed N (default 0) for the seeded random inputs: NumPy takes seeds from 0, and
    flowc at most 2**64 - 1."""
    return click.option(
        "--seed",
        type=click.IntRange(0, (1 << 64) - 1),
        default=0,
        show_default=True,
        metavar="N",
        help=help,
    )


def output_option(
    dest: str, help: str, *, directory: bool = False, required: bool = False
) -> Decorator[Any]:
    """-o/--output: a file (OUT.npz, OUT.flow) or, with ``directory``, a project folder."""
    kind = click.Path(file_okay=not directory, dir_okay=directory, path_type=Path)
    return click.option("-o", "--output", dest, type=kind, required=required, help=help)


def sanitize_option(help: str) -> Decorator[Any]:
    """--sanitize address,undefined: the host build with sanitizers."""
    return text_option("--sanitize", "address,undefined", help)


def project_argument(fn: F) -> F:
    """PROJECT: a directory made by `flowc compile`."""
    return click.argument("project", type=click.Path(file_okay=False, path_type=Path))(fn)
