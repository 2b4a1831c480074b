#!/usr/bin/env bash
# tools/gpu_check.sh: proves ringllm's GPU path on a machine with one CUDA GPU.
#
#   bash tools/gpu_check.sh            (from the repository root)
#
# Meant to finish in under 8 minutes, a cold install of torch's ~3 GB of CUDA wheels
# included. Steps, each under `timeout` (seconds, overridable through the variables
# named; with the environment probe, CLI probe and summary the limits add up to 9.5 min):
#   1. setup        a venv ($VENV, default .venv-gpu) with `pip install -e '.[test,gpu]'`;
#                   stops here, saying why, when torch sees no CUDA device    INSTALL_TIMEOUT_S=180
#                   (SKIP_INSTALL=1: use an existing $VENV as it is, e.g. offline)
#   2. gpu_tests    pytest -m gpu tests/cuda: every kernel against TorchOps   TESTS_TIMEOUT_S=90
#   3. kernels      ringllm bench kernels: decode GB/s vs the copy GB/s       KERNELS_TIMEOUT_S=60
#   4. throughput   ringllm bench throughput, Llama-3-8B shape, random bf16   MODEL_TIMEOUT_S=30
#                   weights made on the GPU (--load-format dummy)             THROUGHPUT_TIMEOUT_S=120
#   5. summary      targets and pass/fail
#
# Results go to ${OUT:-gpu_check_out}/ as JSON: environment.json, gpu_tests.json (from
# pytest's JUnit XML, also kept), kernels.json, throughput.json, summary.json; plus one
# <step>.log each. The exit status
# is 0 only when every step ran and every target was met.
#
# Targets: the decode kernel reaches >= 70% of the device's copy bandwidth (and matches
# TorchOps); more than 8,000 output tokens/s end to end (256 prompts of 512 tokens, 128
# output tokens each, bf16, max 256 sequences and 8192 tokens per step). Every gpu test
# must pass: a skipped one means the GPU path was not exercised, and fails the check.
#
# NOTE which torch this installs: torch==2.13.0 (pinned in setup.cfg) resolves on Linux
# x86_64, from PyPI, to torch-2.13.0-cp3XX-manylinux_2_28_x86_64.whl, the CUDA 13.0
# build: it pulls cuda-toolkit[cublas,cudart,...]==13.0.3, nvidia-cudnn-cu13 and
# nvidia-nccl-cu13 wheels (about 3 GB in all) and needs an NVIDIA driver for CUDA 13
# (r580 or newer). On an older driver torch sees no GPU; then point TORCH_INDEX_URL at
# PyTorch's own wheel index for a CUDA 12 build (its cu126/cu128 index) and rerun: that
# torch is installed before the project. The gpu extra's cupy-cuda12x and
# nvidia-nccl-cu12 run on either driver. NVRTC (CuPy's compiler) needs cuda_fp16.h and
# cuda_bf16.h: ringllm's loader finds them in a CUDA toolkit or in the
# nvidia-cuda-runtime-cu12 wheel, which step 1 installs for that reason.
set -euo pipefail

OUT="${OUT:-gpu_check_out}"
VENV="${VENV:-.venv-gpu}"
PYTHON="${PYTHON:-python3}"
INSTALL_TIMEOUT_S="${INSTALL_TIMEOUT_S:-180}"
TESTS_TIMEOUT_S="${TESTS_TIMEOUT_S:-90}"
KERNELS_TIMEOUT_S="${KERNELS_TIMEOUT_S:-60}"
MODEL_TIMEOUT_S="${MODEL_TIMEOUT_S:-30}"
THROUGHPUT_TIMEOUT_S="${THROUGHPUT_TIMEOUT_S:-120}"
MODEL_DIR="$OUT/llama3-8b-shape"

say() { printf '[gpu_check %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() {
  say "STOPPED: $*"
  exit 1
}

# run_step NAME LIMIT_S COMMAND...: runs COMMAND under `timeout`, its output shown and
# kept in $OUT/NAME.log; appends "NAME<TAB>exit status<TAB>seconds" to $OUT/steps.tsv.
# Returns the command's exit status (124: timed out) and never exits the script itself.
run_step() {
  local name=$1 limit_s=$2 start_s=$SECONDS rc=0
  shift 2
  local command_line="$*"
  say "step $name (at most ${limit_s} s): ${command_line%%$'\n'*}"
  timeout --kill-after=10 "$limit_s" "$@" 2>&1 | tee "$OUT/$name.log" || rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start_s))" >>"$OUT/steps.tsv"
  if [[ $rc -eq 124 ]]; then
    say "step $name timed out after ${limit_s} s (see $OUT/$name.log)"
  elif [[ $rc -ne 0 ]]; then
    say "step $name failed with exit status $rc (see $OUT/$name.log)"
  fi
  return "$rc"
}

# Records a step that could not run because an earlier one failed.
skip_step() {
  printf '%s\t%s\t0\n' "$1" "skipped" >>"$OUT/steps.tsv"
  say "step $1 skipped: $2"
}

check_preconditions() {
  [[ -f setup.cfg && -f tools/gpu_check.sh && -d cuda ]] ||
    die "run this from the ringllm repository root (no setup.cfg / cuda/ here: $PWD)"
  command -v timeout >/dev/null || die "'timeout' (GNU coreutils) is not installed"
  command -v "$PYTHON" >/dev/null || die "no $PYTHON on PATH; set PYTHON=/path/to/python3.11+"
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
    die "$PYTHON is $("$PYTHON" -V 2>&1); ringllm needs Python >= 3.11 (set PYTHON=...)"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >&2 ||
      say "nvidia-smi failed: the driver may not be loaded"
  else
    say "no nvidia-smi on PATH: carrying on, torch will tell whether it sees a GPU"
  fi
  mkdir -p "$OUT"
  : >"$OUT/steps.tsv"
}

# Step 1 as one script, so that one time limit covers it all. It reads VENV, PYTHON and
# TORCH_INDEX_URL from the environment (exported below), so no value is pasted into code.
# shellcheck disable=SC2016  # single quotes on purpose: the child bash expands these
INSTALL_SH='
set -euo pipefail
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --upgrade pip
if [[ -n "$TORCH_INDEX_URL" ]]; then
  "$VENV/bin/python" -m pip install "torch==2.13.0" --index-url "$TORCH_INDEX_URL"
fi
"$VENV/bin/python" -m pip install -e ".[test,gpu]" nvidia-cuda-runtime-cu12
'

# Writes environment.json; exits 3 when torch sees no CUDA device.
ENVIRONMENT_PY='
import json, sys
import torch
info = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available()}
if info["cuda_available"]:
    props = torch.cuda.get_device_properties(0)
    info.update(device=props.name, capability=f"{props.major}.{props.minor}",
                memory_bytes=props.total_memory, device_count=torch.cuda.device_count())
try:
    import cupy
    info.update(cupy=cupy.__version__, cupy_cuda_runtime=cupy.cuda.runtime.runtimeGetVersion(),
                cuda_driver=cupy.cuda.runtime.driverGetVersion())
except Exception as e:  # reported, not fatal here: the gpu tests will show it
    info["cupy_error"] = repr(e)
from ringllm.cuda.loader import cuda_include_options
info["nvrtc_include_options"] = cuda_include_options()
json.dump(info, open(sys.argv[1], "w"), indent=2)
print(json.dumps(info, indent=2))
sys.exit(0 if info["cuda_available"] else 3)
'

setup_environment() {
  export VENV PYTHON TORCH_INDEX_URL="${TORCH_INDEX_URL:-}"
  if [[ ${SKIP_INSTALL:-0} == 1 ]]; then
    [[ -x "$VENV/bin/python" ]] || die "SKIP_INSTALL=1 but $VENV/bin/python does not exist"
    skip_step setup "SKIP_INSTALL=1: using $VENV as it is"
  else
    run_step setup "$INSTALL_TIMEOUT_S" bash -c "$INSTALL_SH" ||
      die "the install failed (or ran past ${INSTALL_TIMEOUT_S} s: raise INSTALL_TIMEOUT_S on a slow link; offline, install by hand and rerun with SKIP_INSTALL=1); see $OUT/setup.log. Without python3-venv, Debian/Ubuntu need: apt-get install python3-venv"
  fi
  local rc=0
  run_step environment 30 "$VENV/bin/python" -c "$ENVIRONMENT_PY" "$OUT/environment.json" || rc=$?
  if [[ $rc -eq 3 ]]; then
    local built_for
    built_for=$("$VENV/bin/python" -c 'import torch; print(torch.__version__, torch.version.cuda)')
    if [[ $built_for == *" None" ]]; then
      die "torch ${built_for% None} is a CPU-only build (pip took it from a CPU wheel index: check pip.conf / PIP_INDEX_URL, or set TORCH_INDEX_URL to a CUDA wheel index) and sees no GPU."
    fi
    die "torch ${built_for/ / (CUDA }) sees no CUDA device. If nvidia-smi shows a GPU, its driver is likely older than this torch's CUDA needs: rerun with TORCH_INDEX_URL set to a CUDA 12 wheel index (see the NOTE at the top of this script)."
  fi
  [[ $rc -eq 0 ]] || die "could not inspect the environment; see $OUT/environment.log"
  check_cli_tools
}

# Warns early (not fatal: the gpu tests still run) when this checkout's `ringllm` lacks
# a benchmark the later steps call.
check_cli_tools() {
  local tool
  for tool in kernels throughput; do
    if ! timeout 20 "$VENV/bin/ringllm" bench "$tool" --help >/dev/null 2>&1; then
      say "WARNING: 'ringllm bench $tool' is not available in this checkout (tools/cli.py must register tools/bench/commands.py, which registers it); its step will fail"
    fi
  done
}

gpu_tests() {
  run_step gpu_tests "$TESTS_TIMEOUT_S" "$VENV/bin/python" -m pytest -m gpu tests/cuda -q \
    -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml" || true
}

kernels() {
  run_step kernels "$KERNELS_TIMEOUT_S" "$VENV/bin/ringllm" bench kernels --device cuda \
    --json "$OUT/kernels.json" || true
}

# Llama-3-8B's shape (config only: --load-format dummy makes the bf16 weights on the GPU)
# and the offline workload; arrays so the tests can parse them with the real parsers.
MAKE_MODEL_ARGS=(
  --arch llama --hidden-size 4096 --intermediate-size 14336 --num-layers 32
  --num-heads 32 --num-kv-heads 8 --model-vocab-size 128256 --rope-scaling llama3
  --rope-theta 500000 --max-position-embeddings 8192 --dtype bfloat16 --config-only
)
THROUGHPUT_ARGS=(
  --load-format dummy --device cuda --dtype bfloat16
  --num-prompts 256 --input-len 512 --output-len 128 --ignore-eos
  --max-num-seqs 256 --max-num-batched-tokens 8192
)

throughput() {
  if ! run_step make_model "$MODEL_TIMEOUT_S" "$VENV/bin/ringllm" make-model "$MODEL_DIR" \
    "${MAKE_MODEL_ARGS[@]}"; then
    skip_step throughput "make-model failed"
    return 0
  fi
  run_step throughput "$THROUGHPUT_TIMEOUT_S" "$VENV/bin/ringllm" bench throughput \
    --model "$MODEL_DIR" "${THROUGHPUT_ARGS[@]}" --result-json "$OUT/throughput.json" || true
}

# Reads what the steps left in $OUT and writes summary.json; exits 1 unless all passed.
SUMMARY_PY='
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path

out = Path(sys.argv[1])
total_s = int(sys.argv[2])

def load(name):
    path = out / name
    return json.loads(path.read_text()) if path.exists() else None

steps = []
for line in (out / "steps.tsv").read_text().splitlines():
    name, rc, seconds = line.split("\t")
    steps.append({"name": name, "exit_status": rc, "seconds": int(seconds),
                  "ok": rc == "0"})
ran = {s["name"]: s["ok"] for s in steps}

tests = {"passed": False, "tests": 0, "failures": 0, "errors": 0, "skipped": 0}
if (out / "gpu_tests.xml").exists():
    root = ET.parse(out / "gpu_tests.xml").getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    for key in ("tests", "failures", "errors", "skipped"):
        tests[key] = sum(int(s.get(key, 0)) for s in suites)
    tests["passed"] = bool(ran.get("gpu_tests") and tests["tests"] > 0
                           and tests["failures"] + tests["errors"] + tests["skipped"] == 0)
    for outcome in ("failure", "error", "skipped"):
        tests[outcome + "_names"] = [
            case.get("classname", "") + "::" + case.get("name", "")
            for case in root.iter("testcase")
            if case.find(outcome) is not None
        ]
(out / "gpu_tests.json").write_text(json.dumps(tests, indent=2) + "\n")

kernels = load("kernels.json")
decode = {"target": "decode kernel >= 70% of copy bandwidth, output matches TorchOps",
          "passed": False}
if kernels:
    judged = kernels["variants"][kernels["judged_variant"]]
    timing = judged[kernels["judged_timing"]]
    decode.update(variant=kernels["judged_variant"], timing=kernels["judged_timing"],
                  fraction_of_copy=kernels["fraction_of_copy"], decode_gb_per_s=timing["gb_per_s"],
                  copy_gb_per_s=kernels["copy"]["gb_per_s"], all_correct=kernels["all_correct"],
                  passed=bool(ran.get("kernels") and kernels["meets_target"]))

result = load("throughput.json")
e2e = {"target": "> 8000 output tokens/s", "passed": False}
if result:
    keys = ("output_tokens_per_second", "requests_per_second", "total_output_tokens",
            "elapsed_time", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms")
    e2e.update({k: result.get(k) for k in keys})
    e2e["passed"] = bool(ran.get("throughput") and result["output_tokens_per_second"] > 8000)

summary = {"passed": tests["passed"] and decode["passed"] and e2e["passed"],
           "gpu_tests": tests, "decode_kernel": decode, "throughput": e2e,
           "environment": load("environment.json"), "steps": steps, "total_seconds": total_s}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps({k: summary[k] for k in ("passed", "gpu_tests", "decode_kernel", "throughput")},
                 indent=2))
sys.exit(0 if summary["passed"] else 1)
'

main() {
  check_preconditions
  setup_environment
  gpu_tests
  kernels
  throughput
  local rc=0
  say "summary ($SECONDS s so far):"
  timeout 20 "$VENV/bin/python" -c "$SUMMARY_PY" "$OUT" "$SECONDS" || rc=$?
  if [[ $rc -eq 0 ]]; then
    say "PASSED: every target met; results in $OUT/summary.json"
  else
    say "FAILED: see $OUT/summary.json and the step logs in $OUT/"
  fi
  return "$rc"
}

# Sourced (the tests do, to run the summary and run_step on the CPU): define, do not run.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  main "$@"
fi
