# rehearse_call DEST ARCHIVE GPU_CHECK_ARGS...: one device call rehearsed on the CPU as the device runs it (one
# `bench/gpu_check.sh --rehearse` command), its archive unpacked into DEST beside command.txt (the command, its
# exit status, the archive's size) and stdout.txt. Sourced by the rehearsal scripts beside it.
rehearse_call() {
  local dest=$1 archive=$2
  shift 2
  rm -rf "$dest" && mkdir -p "$dest"
  echo "bench/gpu_check.sh --rehearse --archive OUT/$(basename "$archive") $* -> $(basename "$dest")/" |
    tee "$dest/command.txt"
  bench/gpu_check.sh --rehearse --archive "$archive" "$@" >"$dest/stdout.txt" 2>&1
  echo "exit $?" >>"$dest/command.txt"
  tar -xzf "$archive" -C "$dest"
  ls -l "$archive" | awk '{print "archive bytes", $5}' >>"$dest/command.txt"
  rm -f "$archive"
  tail -1 "$dest/stdout.txt"
}
