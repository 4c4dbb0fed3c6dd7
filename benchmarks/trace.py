"""Reading a JAX profiler trace (`perfetto_trace.json.gz`): its kernels, and the device time per layer kind.

One parser for `scripts/trace_summary.py` and the benchmarks that profile (`python -m benchmarks.generate --profile
DIR`). The kernels of a trace are the complete events of its device processes (`/device:GPU:0`, ...); a CPU trace
has none, and its kernels are the XLA ops the host runs (events carrying an `hlo_op`), the same structure.

Attribution: each kernel is matched to its HLO instruction, and the compiled program's HLO text gives that
instruction's `op_name`, the `jax.named_scope` path it was traced under (`jit(step)/decoder_layer_3/kda/...`; a
weight's or a cache's, its layer's). An instruction without one (a copy or layout change XLA added) takes its called
computation's, else an operand's (`hlo_scopes`). A kernel's instruction is its `hlo_op` where that names one (a CPU
trace). On a GPU with XLA command buffers (CUDA graphs) every kernel's `hlo_op` is the command buffer
(`command_buffer_1`), so the kernel's name and its place in the trace give it instead (`hlo_launches`). The name
gives the launch group: the fusions of one `deduplicated_name` (XLA compiles them into one kernel or a few, each
named like a member, '.' and '-' as '_'), the Pallas calls of one kernel (`weight_only_gemv`, variants
`weight_only_gemv__1`, ...), the top-level copies (`memcpy...` kernels). The k-th kernel of a group in the trace is
the group's (k mod n)-th of n instructions in the program's schedule order (the HLO text is scheduled). Anything
else falls back to the kernel name read as an instruction's. The path's first layer scope names the kind:
`kda`, `mla`, `moe` / `mlp`, `lm_head` / `sampling` (`LAYER_KINDS`); anything else is "other" (embedding, the
decoder layers' norms, the final norm, unscoped ops).
"""

from __future__ import annotations

import collections
import gzip
import json
import pathlib
import re

TRACE_FILE = "perfetto_trace.json.gz"
HLO_FILE = "program.hlo.txt"  # the profiled program's compiled HLO text, beside the trace's plugins/ folder
LAYER_KINDS = {
    "kda": "KDA layer",
    "mla": "MLA layer",
    "moe": "MoE / dense FFN",
    "mlp": "MoE / dense FFN",
    "lm_head": "lm_head / sampling",
    "sampling": "lm_head / sampling",
}
OTHER = "other"
KIND_ORDER = (*dict.fromkeys(LAYER_KINDS.values()), OTHER)

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_OP_NAME = re.compile(r'op_name="(?P<op_name>(?:[^"\\]|\\.)*)"')
_REFERENCE = re.compile(r"%(?P<name>[\w.\-]+)")
_SCOPE_PARTS = re.compile(r"[/\[\]\\'.]+")
_MIXER = re.compile(r"decoder_layer_(\d+)/(kda|mla)/")
_LAYER_PARAMETER = re.compile(r"params\[\\?'model\\?'\]\[\\?'layers\\?'\]\[(?P<layer>\d+)\]\[\\?'(?P<module>\w+)\\?'\]")
_CACHE_PARAMETER = re.compile(r"cache\.layers\[(?P<layer>\d+)\]")
_MODULE = re.compile(r"^HloModule\s+(?P<name>[^\s,]+)")
_OPCODE = re.compile(r"(?:^|\s)(?P<opcode>[a-z][\w\-]*)\(")
_FUSED_COMPUTATION = re.compile(r"calls=%(?P<name>[\w.\-]+)")
_DEDUPLICATED_NAME = re.compile(r'deduplicated_name="(?P<name>[\w.\-]+)"')
_PALLAS_KERNEL = re.compile(r"/(?P<kernel>\w+)/pallas_call$")
_KERNEL_VARIANT = re.compile(r"__\d+$")
MEMCPY = "memcpy"  # the launch name of a top-level copy: its kernel is the driver's memcpy32_post, ...


def find_trace(path: pathlib.Path) -> pathlib.Path:
    """`path` itself (a file), or the newest TRACE_FILE of the profile written into it (under its `plugins/`
    folder; a profile directory may hold other programs' profiles in folders of their own, `benchmarks.generate
    --profile DIR --mtp K`'s DIR/decode_group), else the newest below it; SystemExit naming the path otherwise."""
    if not path.exists():
        raise SystemExit(f"error: {path} does not exist")
    if path.is_file():
        return path
    own = path / "plugins"
    traces = sorted((own if own.is_dir() else path).rglob(TRACE_FILE), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise SystemExit(f"error: {path}: no {TRACE_FILE} below it (benchmarks/generate.py --profile DIR)")
    return traces[-1]


def load_trace(path: pathlib.Path) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def kernels(trace: dict, module: str | None = None) -> list[dict]:
    """The trace's kernels (module docstring), sorted by start; with `module`, those of that HLO module only (events
    that name none are kept)."""
    events = [event for event in trace["traceEvents"] if event.get("ph") == "X"]
    devices = {
        event["pid"]
        for event in trace["traceEvents"]
        if event.get("ph") == "M"
        and event.get("name") == "process_name"
        and event["args"].get("name", "").startswith("/device:")
    }
    if devices:
        chosen = [event for event in events if event["pid"] in devices]
    else:
        chosen = [event for event in events if "hlo_op" in event.get("args", {})]
    if module is not None:
        chosen = [event for event in chosen if event.get("args", {}).get("hlo_module", module) == module]
    return sorted(chosen, key=lambda event: event["ts"])


def device_seconds(path: pathlib.Path, calls: int) -> float:
    """Seconds of kernel time a call in the trace at `path` (`find_trace`) of `calls` calls: the kernels'
    durations summed (overlapping kernels count twice)."""
    return sum(event["dur"] for event in kernels(load_trace(find_trace(path)))) / calls * 1e-6


def summarize(kernels: list[dict], steps: int, top: int, small_us: float, by_kind: bool = False) -> str:
    """Per step: the kernel count and busy time, the `top` kernels by time (repeated launches of one name are one
    row; with by_kind every numbered variant too) and the tail of kernels averaging under small_us."""
    suffix = re.compile(r"[._]\d+$" if by_kind else r"\.\d+$")
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for kernel in kernels:
        by_name[suffix.sub("", kernel["name"])].append(kernel["dur"])
    busy = sum(kernel["dur"] for kernel in kernels)
    lines = [
        f"{len(kernels) / steps:.0f} kernels and {busy / steps:.1f} us of device time per step ({steps} steps)",
        "",
        "| us / step | calls / step | us / call | kernel |",
        "|---|---|---|---|",
    ]
    ranked = sorted(by_name.items(), key=lambda item: -sum(item[1]))
    for name, durations in ranked[:top]:
        lines.append(
            f"| {sum(durations) / steps:.1f} | {len(durations) / steps:.1f} | "
            f"{sum(durations) / len(durations):.1f} | {name} |"
        )
    small = [d for durations in by_name.values() for d in durations if sum(durations) / len(durations) < small_us]
    lines += [
        "",
        f"kernels averaging under {small_us:g} us: {len(small) / steps:.0f} per step, "
        f"{sum(small) / steps:.1f} us per step",
    ]
    return "\n".join(lines)


def idle_table(kernels: list[dict], steps: int, top: int = 10) -> str:
    """Per step: the span from the first kernel's start to the last one's end, the idle part of it (no kernel
    running), and the `top` kernels by the idle time just before them (repeated launches of one name are one row):
    which launches the device waits for (a kernel after a host sync, a program's first kernel)."""
    suffix = re.compile(r"\.\d+$")
    idle_before: dict[str, list[float]] = collections.defaultdict(list)
    reach = kernels[0]["ts"]
    for kernel in kernels:  # sorted by start
        idle_before[suffix.sub("", kernel["name"])].append(max(0.0, kernel["ts"] - reach))
        reach = max(reach, kernel["ts"] + kernel["dur"])
    span = reach - kernels[0]["ts"]
    idle = sum(sum(gaps) for gaps in idle_before.values())
    lines = [
        f"span {span / steps:.1f} us per step: idle {idle / steps:.1f} us ({idle / span:.0%})",
        "",
        "| idle us before, per step | launches / step | idle us before, per launch | kernel |",
        "|---|---|---|---|",
    ]
    for name, gaps in sorted(idle_before.items(), key=lambda item: -sum(item[1]))[:top]:
        lines.append(f"| {sum(gaps) / steps:.1f} | {len(gaps) / steps:.1f} | {sum(gaps) / len(gaps):.1f} | {name} |")
    return "\n".join(lines)


def module_table(kernels: list[dict]) -> str:
    """The device time of each program (the kernels' `hlo_module`; "?" for kernels that name none) over the
    trace's span, and the span's idle part (no kernel running): where a served run's time goes, program by
    program."""
    by_module: dict[str, list[float]] = collections.defaultdict(list)
    for kernel in kernels:
        by_module[kernel.get("args", {}).get("hlo_module", "?")].append(kernel["dur"])
    start = kernels[0]["ts"]
    span = max(kernel["ts"] + kernel["dur"] for kernel in kernels) - start
    busy, reach = 0.0, start  # the union of the kernels' intervals (sorted by start)
    for kernel in kernels:
        end = kernel["ts"] + kernel["dur"]
        busy += max(0.0, end - max(reach, kernel["ts"]))
        reach = max(reach, end)
    lines = [
        f"span {span / 1e3:.1f} ms: busy {busy / 1e3:.1f} ms, idle {(span - busy) / 1e3:.1f} ms "
        f"({(span - busy) / span:.0%})",
        "",
        "| program | kernels | device ms | % of span |",
        "|---|---|---|---|",
    ]
    for module, durations in sorted(by_module.items(), key=lambda item: -sum(item[1])):
        lines.append(f"| {module} | {len(durations)} | {sum(durations) / 1e3:.1f} | {sum(durations) / span:.0%} |")
    return "\n".join(lines)


def hlo_module_name(hlo_text: str) -> str:
    match = _MODULE.match(hlo_text)
    if match is None:
        raise ValueError("not an HLO module's text: its first line does not start with 'HloModule NAME'")
    return match["name"]


def hlo_computations(hlo_text: str) -> dict[str, list[tuple[str, str]]]:
    """{computation name: [(instruction name, the rest of its line after '='), ...] in text order} of an HLO
    module's text."""
    computations: dict[str, list[tuple[str, str]]] = {}
    instructions: list[tuple[str, str]] = []
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            instructions = computations.setdefault(header["name"], [])
            continue
        instruction = _INSTRUCTION.match(line)
        if instruction is not None:
            instructions.append((instruction["name"], instruction["rest"]))
    return computations


def opcode(rest: str) -> str | None:
    """The opcode of an instruction from the rest of its line after '=' (`hlo_computations`), None if none."""
    match = _OPCODE.search(rest)
    return None if match is None else match["opcode"]


def hlo_scopes(hlo_text: str) -> dict[str, str]:
    """{instruction name: its op_name} for every instruction of a compiled program's HLO text (`compiled.
    as_text()`) that has one or inherits one (module docstring); also each computation's, under its name (its
    instructions' first that names a layer kind, else their first; no constant's). A parameter's op_name
    (`params['model']['layers'][1]['attention'][...]`, which a weight's conversion or layout copy inherits) becomes
    its layer's scope (`decoder_layer_1/mla`, the layer's mixer as the program's own op_names name it), and so does
    a cache's (`cache.layers[1].latent`, which its copy inherits). An instruction without one inherits from its
    called computations first, then its operands, the first that names a layer kind, else the first that has one (a
    dot XLA rewrote takes its weight's layer)."""
    mixers = dict(_MIXER.findall(hlo_text))
    scopes: dict[str, str] = {}
    computations: set[str] = set()
    computation = None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            computation = header["name"]
            computations.add(computation)
            continue
        instruction = _INSTRUCTION.match(line)
        if instruction is None:
            continue
        own = _OP_NAME.search(instruction["rest"])
        if own:
            scope = _parameter_scope(own["op_name"], mixers)
        else:
            refs = [ref["name"] for ref in _REFERENCE.finditer(instruction["rest"])]
            refs.sort(key=lambda name: name not in computations)  # stable: the operands in order
            inherited = [scopes[name] for name in refs if name in scopes]
            scope = next((s for s in inherited if layer_kind(s) != OTHER), next(iter(inherited), None))
        if scope:
            scopes[instruction["name"]] = scope
            if computation is not None and _names_its_computation(scope, scopes.get(computation), instruction["rest"]):
                scopes[computation] = scope
    return scopes


def _names_its_computation(scope: str, computation_scope: str | None, rest: str) -> bool:
    """Whether an instruction's scope becomes its computation's (`hlo_scopes`); never a constant's: XLA shares one
    constant among scopes."""
    opcode = _OPCODE.search(rest)
    if opcode is not None and opcode["opcode"] == "constant":
        return False
    return computation_scope is None or (layer_kind(computation_scope) == OTHER and layer_kind(scope) != OTHER)


def _parameter_scope(op_name: str, mixers: dict[str, str]) -> str:
    """`op_name`, or for a decoder layer's parameter or cache its layer's scope (`hlo_scopes`)."""
    cache = _CACHE_PARAMETER.match(op_name)
    if cache is not None and cache["layer"] in mixers:
        return f"decoder_layer_{cache['layer']}/{mixers[cache['layer']]}"
    parameter = _LAYER_PARAMETER.match(op_name)
    if parameter is None:
        return op_name
    layer, module = parameter["layer"], parameter["module"]
    return f"decoder_layer_{layer}/{mixers.get(layer, module) if module == 'attention' else module}"


def hlo_launches(hlo_text: str) -> dict[str, tuple[str, ...]]:
    """{kernel name: the names of its launch group's instructions in schedule order} for the instructions of a
    compiled GPU program's HLO text that launch a kernel the trace names (module docstring), those of the
    computations that are not a fusion's. A fusion's group is the fusions of its `deduplicated_name` (else itself):
    XLA compiles a group into one kernel or a few, each named like one member ('.' and '-' as '_'). A Pallas call's
    group is its kernel's (the op_name's scope before `pallas_call`), a copy's MEMCPY."""
    fused = {match["name"] for match in _FUSED_COMPUTATION.finditer(hlo_text)}
    groups: dict[str, list[str]] = collections.defaultdict(list)
    kernel_groups: dict[str, str] = {}
    computation = None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            computation = header["name"]
            continue
        instruction = _INSTRUCTION.match(line)
        if instruction is None or computation in fused:
            continue
        launch = _launch(instruction["name"], instruction["rest"])
        if launch is not None:
            kernel, group = launch
            groups[group].append(instruction["name"])
            kernel_groups[kernel] = group
    return {kernel: tuple(groups[group]) for kernel, group in kernel_groups.items()}


def _launch(name: str, rest: str) -> tuple[str, str] | None:
    """(the kernel name, the launch group) of an instruction (`hlo_launches`), None for one that launches no kernel
    the trace names."""
    opcode = _OPCODE.search(rest)
    if opcode is None:
        return None
    if opcode["opcode"] == "fusion":
        deduplicated = _DEDUPLICATED_NAME.search(rest)
        return _kernel_name(name), deduplicated["name"] if deduplicated else name
    if opcode["opcode"] == "copy":
        return MEMCPY, MEMCPY
    op_name = _OP_NAME.search(rest)
    kernel = _PALLAS_KERNEL.search(op_name["op_name"]) if opcode["opcode"] == "custom-call" and op_name else None
    return (kernel["kernel"], kernel["kernel"]) if kernel else None


def _kernel_name(instruction: str) -> str:
    """The name a GPU trace gives the kernel of an XLA instruction: '.' and '-' as '_'."""
    return re.sub(r"[.\-]", "_", instruction)


def kernel_launch_name(kernel_name: str) -> str:
    """A trace kernel's launch name (`hlo_launches`): MEMCPY for a memcpy, a Pallas kernel's variant suffix
    (`__1`) dropped."""
    return MEMCPY if kernel_name.startswith(MEMCPY) else _KERNEL_VARIANT.sub("", kernel_name)


def layer_kind(scope: str | None) -> str:
    """The LAYER_KINDS entry of the first layer scope in an op_name path (`lm_head` of a parameter's too), else
    OTHER."""
    for part in _SCOPE_PARTS.split(scope or ""):
        if part in LAYER_KINDS:
            return LAYER_KINDS[part]
    return OTHER


def kernel_scopes(
    kernels: list[dict], scopes: dict[str, str], launches: dict[str, tuple[str, ...]] | None = None
) -> list[str | None]:
    """Each kernel's scope (module docstring): its `hlo_op`'s where that has one; else, given the program's
    `hlo_launches`, the k-th kernel of a launch group in time order takes the (k mod n)-th of its n instructions';
    else its name's read as an instruction's."""
    by_kernel_name = {_kernel_name(name): scope for name, scope in scopes.items()}
    launched = collections.Counter()
    chosen = []
    for kernel in kernels:
        op = kernel.get("args", {}).get("hlo_op")
        launch = kernel_launch_name(kernel["name"])
        instructions = (launches or {}).get(launch)
        if op in scopes:
            chosen.append(scopes[op])
        elif instructions:
            chosen.append(scopes.get(instructions[launched[instructions] % len(instructions)]))
            launched[instructions] += 1
        else:
            chosen.append(by_kernel_name.get(kernel["name"]))
    return chosen


def time_by_layer_kind(
    kernels: list[dict], scopes: dict[str, str], launches: dict[str, tuple[str, ...]] | None = None
) -> dict[str, tuple[int, float]]:
    """{kind: (kernels, device time in us)} over KIND_ORDER (`kernel_scopes`)."""
    totals = {kind: [0, 0.0] for kind in KIND_ORDER}
    for kernel, scope in zip(kernels, kernel_scopes(kernels, scopes, launches), strict=True):
        total = totals[layer_kind(scope)]
        total[0] += 1
        total[1] += kernel["dur"]
    return {kind: (count, us) for kind, (count, us) in totals.items()}


def layer_kind_table(
    kernels: list[dict], scopes: dict[str, str], steps: int, launches: dict[str, tuple[str, ...]] | None = None
) -> str:
    """Per step: the kernel count and device time, then a row per layer kind (`time_by_layer_kind`)."""
    by_kind = time_by_layer_kind(kernels, scopes, launches)
    busy = sum(us for _, us in by_kind.values())
    lines = [
        f"{len(kernels) / steps:.0f} kernels and {busy / steps:.1f} us of device time per step ({steps} steps)",
        "",
        "| layer kind | us / step | share | kernels / step |",
        "|---|---|---|---|",
    ]
    for kind, (count, us) in by_kind.items():
        lines.append(f"| {kind} | {us / steps:.1f} | {us / busy if busy else 0:.1%} | {count / steps:.1f} |")
    return "\n".join(lines)


def layer_kind_report(directory: pathlib.Path, steps: int) -> str:
    """`layer_kind_table` of the newest trace below `directory`, attributed by the HLO text in directory/HLO_FILE
    (the profiled program's: `benchmarks.common.time_decode` writes both), its kernels only."""
    hlo_text = (directory / HLO_FILE).read_text()
    trace = load_trace(find_trace(directory))
    chosen = kernels(trace, hlo_module_name(hlo_text))
    return layer_kind_table(chosen, hlo_scopes(hlo_text), steps, hlo_launches(hlo_text))


def profile_report(directory: pathlib.Path, steps: int, top: int = 25, small_us: float = 5.0) -> str:
    """`layer_kind_report`, the `top` kernels by time (`summarize`), then where the device idles (`idle_table`):
    what a benchmark's --profile prints."""
    chosen = kernels(load_trace(find_trace(directory)), hlo_module_name((directory / HLO_FILE).read_text()))
    report = [layer_kind_report(directory, steps), summarize(chosen, steps, top, small_us), idle_table(chosen, steps)]
    return "\n\n".join(report)
