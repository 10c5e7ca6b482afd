#!/usr/bin/env bash
# The GPU call plan (README, "Validating a GPU host"), rehearsed on the CPU: each call as the device would run it
# (one gpu_check.sh command, its archive unpacked into callN/, a later call --from the calls it resumes).
# Run from the repository root with the host's software first on PATH (bench/rehearsal_env.sh VENV):
#   PATH=VENV/bin:$PATH bench/scripts/rehearse_gpu_calls.sh          (FIRST_CALL=K or CALLS="K ...": only some)
set -uo pipefail
here=bench/results/cpu-rehearsal
work=$(mktemp -d)
n=0
source bench/scripts/rehearse_call.sh
call() {  # call [--from callK ...] STEP ...
  n=$((n + 1))
  [ "$n" -lt "${FIRST_CALL:-1}" ] && return  # FIRST_CALL=K: redo the calls from K on
  [ -n "${CALLS:-}" ] && [[ " $CALLS " != *" $n "* ]] && return  # CALLS="2 5": redo only these
  rehearse_call "$here/call$n" "$work/call$n.tar.gz" "$@"
}
call "$work/out1" host probe
call "$work/out2" tests
call "$work/out3" engine
call "$work/out4" interference
call "$work/out5" compare
call "$work/out6" policy
call --from $here/call6 "$work/out7" policy-eval:balanced
call --from $here/call6 "$work/out8" policy-eval:decode-heavy
call --from $here/call6 --from $here/call7 --from $here/call8 "$work/out9" policy-eval:prefill-heavy policy-verdict
call "$work/out10" partition
call "$work/out11" partition-compare:none,cpu
call "$work/out12" partition-compare:thread
call "$work/out13" frontend
call "$work/out14" sampling kernels
rm -rf "$work"
