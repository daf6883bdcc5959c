"""The benchmark helpers that run without a GPU: bench/ncu_stall_top.py on a small source page,
bench/det_order_model.py on small launches, bench/trace_fwd.py and bench/trace_bwd.py on made-up
timelines, bench/probe_flex_lists.py's list merging, bench_common's grid, FLOP counts and JSON,
bench_gqa's float32 reference against cuflash's CPU reference, bench_common's check before timing,
tools/branch_overlay.sh and tools/patch_overlay.sh on repositories of their own, tools/gpu_ab.sh's
checks of its settings (dry runs), tools/sass_loops.py on a made-up listing;
and that the scripts of bench/ and tools/ and the package name nothing they never define (their
GPU paths do not run here)."""

import builtins
import importlib.util
import json
import math
import pathlib
import symtable
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SOURCE_PAGE = """==PROF== a message before the table
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","stall_long_sb (All)","stall_barrier (All)"
"0x10","HGMMA.64x64x16.F32.BF16","10","5","0","1"
"0x20","@!P0 BRA 0x90","60","60","60","0"
"0x30","MUFU.EX2 R1, R1","30","20","3","27"
"""


def test_stall_top_ranks_and_dumps(tmp_path, monkeypatch, capsys):
    stall_top = load("ncu_stall_top")
    page = tmp_path / "source.csv"
    page.write_text(SOURCE_PAGE)
    dump = tmp_path / "sass.txt"
    monkeypatch.setattr(sys, "argv", ["ncu_stall_top.py", str(page), "--top", "2", "--dump", str(dump)])
    assert stall_top.main() == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "3 instructions, 100 stall samples; top 2:"
    # Most sampled first, with the reasons that hold at least 5% of an instruction's samples.
    assert lines[1].split()[:2] == ["60.00%", "0x20"] and "stall_long_sb 100%" in lines[1]
    assert lines[2].split()[:2] == ["30.00%", "0x30"] and "stall_barrier 90%" in lines[2]
    assert "stall_long_sb 10%" in lines[2]
    assert len(lines) == 3
    # The dump keeps the address order and every instruction.
    dumped = dump.read_text().splitlines()
    assert dumped[0] == "3 instructions, 100 stall samples, in address order"
    assert [line.split()[1] for line in dumped[1:]] == ["0x10", "0x20", "0x30"]


def test_stall_top_without_a_table(tmp_path, monkeypatch, capsys):
    stall_top = load("ncu_stall_top")
    page = tmp_path / "source.csv"
    page.write_text("==ERROR== no kernels were profiled\n")
    monkeypatch.setattr(sys, "argv", ["ncu_stall_top.py", str(page)])
    assert stall_top.main() == 1
    assert "no source table" in capsys.readouterr().out


def test_det_order_model_small_launches():
    model = load("det_order_model")
    # Without the deterministic waits the makespan is the work over the slots: 4 heads of 8
    # column blocks, 10 row blocks each, on 16 slots.
    plain = model.makespan(640, False, False, sms=16, heads=4, batch=1)
    assert plain == (4 * 8 * 10) / 16
    # Rotated starts with every head's column blocks resident together cost nothing ...
    assert model.makespan(640, False, True, sms=16, heads=4, batch=1) == plain
    # ... a fixed order from row block 0 makes the column blocks wait for one another.
    assert model.makespan(640, False, True, order="ascending", sms=16, heads=4, batch=1) > plain
    # Causal: the kernel's order (descending launch) follows the column blocks' own arrival and
    # never waits, but launches the longest walks last; the longest-first mirror image comes
    # within a few idle steps of the heads-inner non-deterministic launch (in the model).
    causal = model.makespan(640, True, False, sms=16, heads=4, batch=1)
    columns = model.makespan(640, True, True, sms=16, heads=4, batch=1)
    longest_first = model.makespan(640, True, True, order="longest_first", sms=16, heads=4, batch=1)
    assert causal <= longest_first < columns

def test_run_settings_names_the_pass():
    """A table's title says which pass of a call it is: tag, options and CUFLASH_* settings."""
    common = load("bench_common")

    class Args:
        tag = "_b"

    settings = common.run_settings(Args(), ["softcap 50"], environ={"CUFLASH_BWD_DQ": "atomics", "PATH": "/bin"})
    assert settings == "tag _b; softcap 50; CUFLASH_BWD_DQ=atomics"
    assert common.titled("backward TFLOP/s", settings) == "backward TFLOP/s; " + settings
    Args.tag = ""
    assert common.titled("forward TFLOP/s", common.run_settings(Args(), environ={})) == "forward TFLOP/s"



def timeline_lines(tag, events, cycles_per_stage, clock_ghz):
    """Two calls (a warm-up, then the one analysed) of one CTA with two warpgroups, each making
    `events`, every stage taking cycles_per_stage in the warm-up and twice that in the second
    call; the global timer ends each warpgroup at its last event's cycles over clock_ghz."""
    lines = []
    for call in range(2):
        scale = cycles_per_stage * (call + 1)
        for wg in (0, 1):
            end_ns = 1000 + round((len(events) - 1) * scale / clock_ghz)
            for k, event in enumerate(events):
                lines.append(f"{tag} 0 0 {wg} {event} {k * scale} 1000 {end_ns}")
        lines.append(f"{tag}-call-end")
    return lines


def trace_lines(cycles_per_stage, clock_ghz):
    """Forward: two tiles per warpgroup."""
    return timeline_lines("fwdtrace", [0] + [1, 2, 3, 4, 5, 8] * 2 + [9], cycles_per_stage, clock_ghz)


def test_trace_fwd_measures_the_clock_and_the_stages(capsys):
    trace = load("trace_fwd")
    assert trace.analyse(trace_lines(1720, 1.72), None, 16) == 0
    out = capsys.readouterr().out
    # The last call counts (its stages took twice the warm-up's cycles): 3440 cycles at the
    # clock measured against the global timer, 1.72 GHz, are 2 us.
    assert "SM clock from the global timer: 1.720 GHz" in out
    line = next(line for line in out.splitlines() if "wg0 epilogue -> tile" in line)
    assert "mean    2.00 us" in line and "n=   1" in line
    # A given clock is used as it is.
    assert trace.analyse(trace_lines(1720, 1.72), 3.44, 16) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "wg1 tile -> first_s" in line)
    assert "mean    1.00 us" in line


def test_trace_fwd_without_trace_lines(capsys):
    trace = load("trace_fwd")
    assert trace.analyse(["fwdtrace-call-end"], None, 16) == 1
    assert "CUFLASH_FWD_TRACE" in capsys.readouterr().out


def bwd_trace_lines(cycles_per_stage, clock_ghz, steps=3):
    """Backward: `steps` steps of the sliced kernel's events per warpgroup."""
    return timeline_lines("bwdtrace", [0] + [10, 11, 12, 13, 14, 15, 16] * steps + [9], cycles_per_stage,
                          clock_ghz)


def test_trace_bwd_steps(capsys):
    trace = load("trace_bwd")
    assert trace.analyse(bwd_trace_lines(1720, 1.72), None) == 0
    out = capsys.readouterr().out
    assert "SM clock from the global timer: 1.720 GHz" in out
    # Each stage 3440 cycles at 1.72 GHz: 2 us; a step is seven stages.
    line = next(line for line in out.splitlines() if "wg1 ds -> dq0" in line)
    assert "mean    2.00 us" in line and "n=   3" in line
    line = next(line for line in out.splitlines() if "step to step" in line)
    assert "n=4 mean 14.00 us" in line
    assert "start to first step: mean 2.00 us" in out and "(epilogue): mean 2.00 us" in out


def test_trace_bwd_turn_waits(capsys):
    trace = load("trace_bwd")
    # The MMA warpgroups' steps as above, and a dQ warp (warpgroup 2) that waits 1, 3 and 5
    # stages for its three turns (2, 6 and 10 us at 2 us a stage), each add taking one stage.
    lines = bwd_trace_lines(1720, 1.72)
    call_end = len(lines) - 1 - lines[::-1].index("bwdtrace-call-end")
    events, cycles, k = [(0, 0)], 3440, 0
    for wait in (1, 3, 5):
        events += [(20, k), (21, k + wait), (22, k + wait + 1)]
        k += wait + 1
    events.append((9, k + 1))
    end_ns = 1000 + round((k + 1) * cycles / 1.72)
    dq_warp = [f"bwdtrace 0 0 2 {event} {stage * cycles} 1000 {end_ns}" for event, stage in events]
    assert trace.analyse(lines[:call_end] + dq_warp + lines[call_end:], None) == 0
    out = capsys.readouterr().out
    # Waits of 18 stages' 2 us against the warp's 13 stages: share 18 / 26 = 0.69.
    assert "dQ warp turn waits: 1 warps; share of the warp's time: median 0.69" in out
    assert "steps      0: n=    1 mean    2.00 us" in out
    assert "steps    2-3: n=    1 mean   10.00 us" in out
    line = next(line for line in out.splitlines() if "wg2 turn_wait -> turn" in line)
    assert "n=   3" in line and "total/wg     18.0 us" in line
    # The MMA warpgroups' totals leave the dQ warp out.
    line = next(line for line in out.splitlines() if "wg1 ds -> dq0" in line)
    assert "mean    2.00 us" in line


def test_trace_bwd_grid_view(capsys):
    trace = load("trace_bwd")
    # Two CTAs at 1 GHz (a cycle a nanosecond): CTA 0 runs 0-10 us with a cut step of 4 us and a
    # whole one of 2 us between 1 us before and 3 us after; CTA 1 runs 5-15 us with two whole
    # steps of 3 us between 2 us before and 2 us after.
    def cta(index, start_us, events):
        end_ns = start_us * 1000 + events[-1][1] * 1000
        return [f"bwdtrace 0 {index} 0 {event} {t * 1000} {start_us * 1000} {end_ns}" for event, t in events]

    lines = (cta(0, 0, [(0, 0), (24, 1), (10, 5), (16, 7), (9, 10)])
             + cta(1, 5, [(0, 0), (10, 2), (10, 5), (16, 8), (9, 10)]) + ["bwdtrace-call-end"])
    assert trace.analyse(lines, None) == 0
    out = capsys.readouterr().out
    # Busy 20 us over a 15 us span, at most 2 at once.
    assert "grid: 2 CTAs over 15.0 us; at most 2 at once; mean running 1.3 (0.667 of the most)" in out
    assert "CTA time: 0.02 CTA-ms over 4 steps (2.0 per CTA)" in out
    assert "cut steps              n=     1 mean    4.00 us  share 0.200" in out
    assert "first whole steps      n=     2 mean    2.50 us  share 0.250" in out
    assert "whole steps            n=     1 mean    3.00 us  share 0.150" in out
    assert "before the first step  n=     2 mean    1.50 us  share 0.150" in out
    assert "after the last step    n=     2 mean    2.50 us  share 0.250" in out


def test_trace_bwd_without_trace_lines(capsys):
    trace = load("trace_bwd")
    assert trace.analyse(["fwdtrace 0 0 0 0 0 0 0", "bwdtrace-call-end"], None) == 1
    assert "CUFLASH_BWD_TRACE" in capsys.readouterr().out


def test_probe_flex_lists_merges_both_lists():
    import numpy as np

    probe = load("probe_flex_lists")
    full_cnt = np.array([[[2, 0]]], np.int32)
    full_idx = np.array([[[[3, 1, 0, 0], [0, 0, 0, 0]]]], np.int32)
    mask_cnt = np.array([[[1, 2]]], np.int32)
    mask_idx = np.array([[[[2, 0, 0, 0], [3, 0, 0, 0]]]], np.int32)
    counts, indices = probe.merged(full_cnt, full_idx, mask_cnt, mask_idx)
    assert counts.tolist() == [[[3, 2]]]
    # Ascending, the unused tail left at 0.
    assert indices.tolist() == [[[[1, 2, 3, 0], [0, 3, 0, 0]]]]


def test_grid_and_flops():
    common = load("bench_common")

    class Args:
        hdims, seqlens = "64,128", "512,16384,32768"

    shapes = list(common.grid(Args))
    assert shapes[:3] == [(64, 512, 32, 32), (64, 16384, 1, 32), (64, 32768, 1, 32)]
    assert common.fwd_flops(2, 3, 5, 7, 8, False) == 4 * 2 * 3 * 5 * 7 * 8
    assert common.fwd_flops(2, 3, 6, 6, 8, True) == 2 * 2 * 3 * 6 * 6 * 8
    assert common.bwd_flops(2, 3, 6, 6, 8, True) == 5 * 2 * 3 * 6 * 6 * 8
    with pytest.raises(ValueError, match="seqlen_q == seqlen_k"):
        common.fwd_flops(1, 1, 4, 8, 8, True)


def test_window_pairs_and_flops():
    common = load("bench_common")
    # Row i sees keys max(0, i - left) .. min(seqlen - 1, i + right).
    assert common.window_pairs(5, 1, 0) == 1 + 2 + 2 + 2 + 2
    assert common.window_pairs(4, 10, 0) == 1 + 2 + 3 + 4  # a window past the keys: causal
    assert common.window_pairs(4, 10, 10) == 16
    assert common.window_pairs(6, 1, 1) == 2 + 3 + 3 + 3 + 3 + 2
    assert common.window_bwd_flops(2, 3, 5, 8, 1, 0) == int(2.5 * 4 * 2 * 3 * 9 * 8)
    with pytest.raises(ValueError):
        common.window_pairs(4, -1, 0)


def test_json_has_no_nan(tmp_path):
    # Failed and skipped measurements are NaN in memory, null in the file, NaN again in tables.
    common = load("bench_common")
    records = [dict(impl="cuflash", hdim=128, seqlen=512, causal=False, fwd_tflops=float("nan"), extra=[float("inf")]),
               dict(impl="cudnn", hdim=128, seqlen=512, causal=False, fwd_tflops=12.5, extra=[])]
    path = tmp_path / "r.json"
    common.write_json(records, path)
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    back = json.loads(text)
    assert back[0]["fwd_tflops"] is None and back[0]["extra"] == [None] and back[1]["fwd_tflops"] == 12.5
    assert math.isnan(common.lookup(back, "fwd_tflops", "cuflash", 128, 512, False))
    lines = common.table_lines("t", back, "fwd_tflops", ["cuflash", "cudnn"], [("r", "cuflash", "cudnn")])
    assert lines[2].split()[-3:] == ["nan", "12.5", "nan"]


@pytest.mark.parametrize("alibi", [False, True])
def test_gqa_reference_is_cuflash_semantics(alibi):
    # bench_gqa checks every column against its own float32 reference: bottom-right causal over
    # grouped heads (and ALiBi as cuflash.scores.alibi adds it), the rules of cuflash's.
    torch = pytest.importorskip("torch")
    cuflash = pytest.importorskip("cuflash")
    gqa = load("bench_gqa")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 4, 32, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(2, 40, 2, 32, generator=gen).to(torch.bfloat16) for _ in range(2))
    score_mod, bias = None, None
    if alibi:
        slopes = torch.tensor(cuflash.scores.alibi_slopes(4))
        score_mod = cuflash.scores.alibi(slopes)
        bias = slopes[:, None, None] * (torch.arange(40)[None, :] - torch.arange(5)[:, None])
    expected = gqa.reference(q, k, v, bias)
    out = cuflash.flash_attn_varlen_func(q, k, v, causal=True, score_mod=score_mod)[0]
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    # --packed: the same tokens as packed sequences, with and without hints, give the batch's
    # output back in its shape.
    for packed, hints in ((False, False), (True, False), (True, True)):
        call = gqa.packed_call(cuflash, q, k, v, packed, hints, causal=True, score_mod=score_mod, num_splits=0)
        out = call()
        assert out.shape == q.shape
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    # Without the mask the output differs: the check has teeth.
    unmasked = cuflash.flash_attn_varlen_func(q, k, v, score_mod=score_mod)[0]
    assert (unmasked.float() - expected).abs().max() > 0.1


def test_ratio_to_the_best_peer():
    common = load("bench_common")
    records = [dict(impl=i, hdim=64, seqlen=512, causal=False, v=x) for i, x in
               (("cuflash", 300.0), ("cudnn", 250.0), ("fa2", 320.0))]
    records += [dict(impl=i, hdim=64, seqlen=1024, causal=False, v=x) for i, x in
                (("cuflash", 300.0), ("cudnn", 200.0), ("fa2", None))]
    lines = common.table_lines("t", records, "v", ["cuflash"], [("c/best", "cuflash", ("cudnn", "fa2"))])
    assert [line.split()[-1] for line in lines[2:]] == ["0.938", "1.500"]


def test_kernel_event_lines():
    # kernel_times.py and bench_gqa --kernel-times print the profiler's rows alike: duration,
    # then the gap since the previous kernel's end (none for the first), then the name, cut.
    common = load("bench_common")
    rows = [("flash_fwd_kernel_sm90<long template>", 31.25, None), ("flash_combine_kernel", 2.5, 1.75)]
    lines = common.kernel_event_lines(rows, name_width=16)
    assert lines == ["       31.2 us  flash_fwd_kernel", "        2.5 us gap      1.8 us  flash_combine_ke"]


def test_checked_time_us_checks_before_it_times(monkeypatch):
    # A column is timed only when its output is within max_err of the reference; otherwise, or
    # when the call raises, it is recorded as skipped with the reason and not timed.
    common = load("bench_common")
    errors = {"close": 0.001, "off": 0.5}
    monkeypatch.setattr(common, "relative_error", lambda results, reference: errors[results[0]])
    monkeypatch.setattr(common, "time_ms", lambda fn, warmup, repeats: 0.25)
    monkeypatch.setattr(common, "cuda_context_ok", lambda: True)
    assert common.checked_time_us(lambda: "close", None, 0.01, 1, 1) == (250.0, 0.001, None)
    us, err, skipped = common.checked_time_us(lambda: "off", None, 0.01, 1, 1, against="FA2's")
    assert math.isnan(us) and err == 0.5 and skipped.startswith("output off: max error 0.5 relative to FA2's")

    def fails():
        raise RuntimeError("no kernel\nsecond line")

    us, err, skipped = common.checked_time_us(fails, None, 0.01, 1, 1)
    assert math.isnan(us) and err is None and skipped == "RuntimeError: no kernel"
    monkeypatch.setattr(common, "cuda_context_ok", lambda: False)
    with pytest.raises(RuntimeError):
        common.checked_time_us(fails, None, 0.01, 1, 1)


def test_checked_time_us_compares_each_output(monkeypatch):
    # A column of several outputs (a backward's dq, dk, dv) is checked tensor by tensor against
    # the reference's.
    common = load("bench_common")
    seen = []
    monkeypatch.setattr(common, "relative_error", lambda results, reference: seen.append((results, reference)) or 0.0)
    monkeypatch.setattr(common, "time_ms", lambda fn, warmup, repeats: 0.5)
    assert common.checked_time_us(lambda: ("dq", "dk"), ("ref_dq", "ref_dk"), 0.01, 1, 1) == (500.0, 0.0, None)
    assert seen == [(["dq", "dk"], ["ref_dq", "ref_dk"])]


def undefined_global_names(path):
    """(scope, name) of every name a module's code reads as a global that the module never binds
    (assigns, imports, defines) and that is not a builtin: what a lost import leaves."""
    top = symtable.symtable(path.read_text(), str(path), "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    known = bound | set(dir(builtins)) | {"__file__"}
    missing = []

    def walk(table):
        missing.extend((table.get_name(), s.get_name()) for s in table.get_symbols()
                       if s.is_referenced() and s.is_global() and s.get_name() not in known)
        for child in table.get_children():
            walk(child)

    walk(top)
    return missing


def test_undefined_names_are_found(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import os\n\ndef columns():\n    return lambda: cuflash.run(os.sep, len)\n")
    assert undefined_global_names(script) == [("lambda", "cuflash")]


@pytest.mark.parametrize("folder", ["bench", "tools", "python/cuflash"])
def test_scripts_read_no_undefined_names(folder):
    paths = sorted((ROOT / folder).rglob("*.py"))
    assert paths
    missing = {str(path.relative_to(ROOT)): undefined_global_names(path) for path in paths}
    assert {name: found for name, found in missing.items() if found} == {}


def test_varlen_layouts():
    np = pytest.importorskip("numpy")
    varlen = load("bench_varlen")
    rng = np.random.default_rng(0)
    assert varlen.lengths_of("uniform:3:256", rng) == [256, 256, 256]
    assert varlen.lengths_of("skewed:4:16384", rng) == [16384, 16, 16, 16]
    mixed = varlen.lengths_of("mixed:64:2048", rng)
    assert len(mixed) == 64 and all(128 <= n <= 2048 for n in mixed)
    with pytest.raises(ValueError, match="skewed:N:L"):
        varlen.lengths_of("ragged:2:8", rng)


def tool_repo(tmp_path, script, base_files):
    """A git repository of its own holding tools/SCRIPT and, committed on main as its base, the
    files of base_files ({path: text}): its path, a git runner (stdout, failing on error) and a
    runner of the script (the completed process; keyword arguments are added to its environment)."""
    import os
    import shutil
    import subprocess

    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    for name in (script, "overlay_dir.sh"):
        shutil.copy(ROOT / "tools" / name, repo / "tools" / name)

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args],
                              cwd=repo, check=True, capture_output=True, text=True).stdout

    def run(*args, **env):
        return subprocess.run(["bash", f"tools/{script}", *args], cwd=repo, capture_output=True, text=True,
                              env={**os.environ, **env})

    git("init", "-q")
    git("symbolic-ref", "HEAD", "refs/heads/main")
    for path, text in base_files.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    git("add", "-A")
    git("commit", "-q", "-m", "base")
    return repo, git, run


def test_branch_overlay(tmp_path):
    # tools/branch_overlay.sh in a repository of its own: a branch's changed files laid out under
    # the folder; refused where the branch deletes a file or main changed the branch's files.
    repo, git, overlay = tool_repo(tmp_path, "branch_overlay.sh", {"src/a.hpp": "a0\n", "src/b.hpp": "b0\n"})
    git("checkout", "-q", "-b", "feature")
    (repo / "src" / "a.hpp").write_text("a1\n")
    (repo / "src" / "new").mkdir()
    (repo / "src" / "new" / "c.hpp").write_text("c1\n")
    git("add", "-A")
    git("commit", "-q", "-m", "feature")
    git("checkout", "-q", "main")
    (repo / "src" / "b.hpp").write_text("b1\n")  # main moves on elsewhere: allowed
    git("commit", "-q", "-am", "main")

    result = overlay("feature", "ab_feature")
    assert result.returncode == 0, result.stderr
    files = sorted(str(p.relative_to(repo / "ab_feature")) for p in (repo / "ab_feature").rglob("*") if p.is_file())
    assert files == ["src/a.hpp", "src/new/c.hpp"]
    assert (repo / "ab_feature" / "src" / "a.hpp").read_text() == "a1\n"

    (repo / "src" / "a.hpp").write_text("a2\n")  # main changes a file of the branch: refused
    git("commit", "-q", "-am", "main again")
    result = overlay("feature", "ab_again")
    assert result.returncode == 2 and "src/a.hpp" in result.stderr and "rebase" in result.stderr
    assert not (repo / "ab_again").exists()

    git("checkout", "-q", "-b", "deletes")
    git("rm", "-q", "src/b.hpp")
    git("commit", "-q", "-m", "delete")
    git("checkout", "-q", "main")
    result = overlay("deletes", "ab_deletes")
    assert result.returncode == 2 and "deletes, renames" in result.stderr

    # A folder with tracked files is never removed; nor is the root, a path outside, .git, or a
    # path through a symlink.
    (repo / "lnk").symlink_to("src")
    for folder in ("src", "tools/", ".", "../x", ".git", ".git/refs", "lnk//", "lnk/sub"):
        result = overlay("feature", folder)
        assert result.returncode == 2, folder
    (repo / "lnk").unlink()
    assert (repo / ".git" / "HEAD").exists()
    assert (repo / "src" / "a.hpp").read_text() == "a2\n" and (repo / "tools" / "branch_overlay.sh").exists()

    # Names with unusual bytes arrive whole (NUL-separated), and a name with pattern characters
    # is not taken for a pattern.
    git("checkout", "-q", "-b", "names")
    (repo / "src" / "caf\u00e9 [1].hpp").write_text("x\n")
    git("add", "-A")
    git("commit", "-q", "-m", "names")
    git("checkout", "-q", "main")
    result = overlay("names", "ab_names")
    assert result.returncode == 0, result.stderr
    assert (repo / "ab_names" / "src" / "caf\u00e9 [1].hpp").read_text() == "x\n"


def test_patch_overlay(tmp_path):
    # tools/patch_overlay.sh in a repository of its own: the files that patches change, applied
    # in order onto HEAD, laid out under the folder; the working tree untouched; refused where a
    # patch does not apply or deletes a file; no scratch worktree left behind.
    repo, git, overlay = tool_repo(tmp_path, "patch_overlay.sh", {"src/a.hpp": "a0\nkeep\n", "src/b.hpp": "b0\n"})
    # Two patches made on top of each other: the second changes a.hpp again and adds a file.
    (repo / "src" / "a.hpp").write_text("a1\nkeep\n")
    (repo / "first.patch").write_text(git("diff"))
    git("commit", "-q", "-am", "first")
    (repo / "src" / "a.hpp").write_text("a1\nkeep2\n")
    (repo / "src" / "new").mkdir()
    (repo / "src" / "new" / "c.hpp").write_text("c1\n")
    git("add", "src")
    (repo / "second.patch").write_text(git("diff", "--cached"))
    git("reset", "-q", "--hard", "HEAD~1")
    (repo / "src" / "b.hpp").write_text("b-local\n")  # an uncommitted edit elsewhere: kept

    result = overlay("ab_both", "first.patch", "second.patch")
    assert result.returncode == 0, result.stderr
    files = sorted(str(p.relative_to(repo / "ab_both")) for p in (repo / "ab_both").rglob("*") if p.is_file())
    assert files == ["src/a.hpp", "src/new/c.hpp"]
    assert (repo / "ab_both" / "src" / "a.hpp").read_text() == "a1\nkeep2\n"
    assert (repo / "src" / "a.hpp").read_text() == "a0\nkeep\n"  # the working tree untouched
    assert (repo / "src" / "b.hpp").read_text() == "b-local\n"
    assert not (repo / "src" / "new").exists()
    assert git("worktree", "list").count("\n") == 1  # the scratch worktree is gone

    # The second patch alone does not apply on HEAD (it was made after the first): refused.
    result = overlay("ab_second", "second.patch")
    assert result.returncode == 2 and "does not apply" in result.stderr
    assert not (repo / "ab_second").exists()

    # A patch that deletes a file: refused.
    git("checkout", "-q", "--", "src/b.hpp")
    git("rm", "-q", "src/b.hpp")
    (repo / "delete.patch").write_text(git("diff", "--cached", "HEAD"))
    git("reset", "-q", "--hard", "HEAD")
    result = overlay("ab_delete", "delete.patch")
    assert result.returncode == 2 and "delete" in result.stderr

    # A folder with tracked files is never removed; nor is the root, a path outside, .git, or a
    # path through a symlink (rm and cp would follow it into tracked files).
    (repo / "lnk").symlink_to("src")
    for folder in ("src", "tools/", ".", "../x", ".git", ".git/refs", "x/.git", "lnk", "lnk//", "lnk/sub", "a//..//b"):
        result = overlay(folder, "first.patch")
        assert result.returncode == 2, folder
    assert (repo / ".git" / "HEAD").exists() and (repo / "src" / "b.hpp").exists()
    assert (repo / "src" / "a.hpp").read_text() == "a0\nkeep\n"
    assert git("worktree", "list").count("\n") == 1

    # A patch that adds a symlink: refused; one that adds an ignored name: kept; a BASE other
    # than HEAD is read as a commit of the main tree, and HEAD's later change to a patched file
    # is refused.
    (repo / "lnk").unlink()
    (repo / ".gitignore").write_text("*.log\n")
    git("add", ".gitignore")
    git("commit", "-q", "-m", "ignore")
    (repo / "src" / "x.log").write_text("log\n")
    git("add", "-f", "src/x.log")
    (repo / "ignored.patch").write_text(git("diff", "--cached"))
    git("reset", "-q", "--hard", "HEAD")
    result = overlay("ab_ignored", "ignored.patch")
    assert result.returncode == 0, result.stderr
    assert (repo / "ab_ignored" / "src" / "x.log").read_text() == "log\n"
    (repo / "src" / "link.hpp").symlink_to("a.hpp")
    git("add", "src/link.hpp")
    (repo / "link.patch").write_text(git("diff", "--cached"))
    git("reset", "-q", "--hard", "HEAD")
    result = overlay("ab_link", "link.patch")
    assert result.returncode == 2 and "link" in result.stderr
    (repo / "src" / "a.hpp").write_text("a9\nkeep\n")
    git("commit", "-q", "-am", "head moves a.hpp")
    result = overlay("ab_base", "first.patch", BASE="HEAD~2")
    assert result.returncode == 2 and "HEAD changed" in result.stderr
    assert git("worktree", "list").count("\n") == 1


def test_gpu_ab_refuses_a_backward_benchmark_without_the_forward(tmp_path):
    # A backward benchmark runs the forward first: a kernel regex that builds only the backward
    # kernels is refused before anything is built; with the forward kernels in it the dry run
    # goes through, as it does for a forward benchmark on the forward kernels.
    repo, _, gpu_ab = tool_repo(tmp_path, "gpu_ab.sh", {})

    def dry_run(regex, bench, args):
        return gpu_ab(OUT=str(repo / "out"), DRY_RUN="1", VARIANTS="base", HDIMS="64;128", REGEX=regex,
                      BENCH=bench, BENCH_ARGS=args, PASSES="1")

    backward_only = "^flash_bwd_hdim(64|128)_bf16_sm90$"
    for bench, args in (("varlen", "--directions bwd"), ("bwd", "--hdims 64,128")):
        result = dry_run(backward_only, bench, args)
        assert result.returncode == 2 and "leaves out flash_fwd_hdim64_bf16_sm90" in result.stderr
    assert dry_run("^flash_(fwd|bwd)_hdim(64|128)_bf16_sm90$", "varlen", "--directions bwd").returncode == 0
    assert dry_run("^flash_fwd_hdim(64|128)_bf16_sm90$", "fwd", "--hdims 64,128").returncode == 0


def test_sass_loops(tmp_path, capsys):
    # tools/sass_loops.py on a made-up listing: one kernel whose loop holds two HGMMAs, an R2UR,
    # a wait before its exponentials and one after; a second loop with no exponentials is left out.
    spec = importlib.util.spec_from_file_location("sass_loops", ROOT / "tools" / "sass_loops.py")
    sass_loops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sass_loops)
    body = [
        "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ",
        "R2UR UR6, R2",
        "WARPGROUP.DEPBAR.LE gsb0, 0x1",
        "MUFU.EX2 R1, R1",
        "MUFU.EX2 R2, R2",
        "HGMMA.64x128x16.F32.BF16 R88, R120, gdesc[UR8], R88",
        "WARPGROUP.DEPBAR.LE gsb0, 0x0",
        "@P0 BRA 0x0100",
        "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ",
        "@P1 BRA 0x0180",
        "EXIT",
        "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R3",
        "BRA 0x0120",  # a retry stub back into the loop: its span holds the EXIT
    ]
    lines = ["\t\tFunction : _Z6kernelv\n", "        /*0000*/                   MOV R1, c[0x0][0x28] ;\n"]
    for i, text in enumerate(body):
        lines.append(f"        /*{0x100 + 0x10 * i:04x}*/                   {text} ;   /* 0x0 */\n")
    listing = tmp_path / "s.txt"
    listing.write_text("".join(lines))
    kernels = sass_loops.functions(lines)
    assert list(kernels) == ["_Z6kernelv"] and len(kernels["_Z6kernelv"]) == 1 + len(body)
    found = sass_loops.loops(kernels["_Z6kernelv"], min_hgmma=2, min_ex2=2)
    assert found == [{"start": 0x100, "end": 0x170, "instructions": 8, "hgmma": 2, "ex2": 2, "r2ur": 1,
                      "depbar": [2, 6], "first_ex2": 3, "last_ex2": 4}]
    assert sass_loops.main([str(listing), "--min-hgmma", "2", "--min-ex2", "2"]) == 0
    assert "R2UR 1, DEPBAR at [2, 6], exponentials 3-4" in capsys.readouterr().out
    assert sass_loops.main([str(listing), "--kernel", "nothing"]) == 1
