# Sourced by .ci/ship and .ci/harden: a test suite run as shards side by side.
#
#   in_shards LOG_PREFIX COMMAND...
#
# runs COMMAND (a pytest command line, `env VAR=value ...` in front if it needs) once per shard,
# all at once, with ATTNX_TEST_SHARD=k/n and one ATTNX_TEST_CLAIMS folder (tests/conftest.py: the
# shards take the tests from one queue, each the next that none has taken), and prints each
# shard's output when all have ended; it fails if any shard failed. One shard per
# core, at least 2 and at most 4: much of a suite's time is one Python thread, so on 2 cores two
# shards took a third less time than one run (205 -> 143 s for the scalar kernel's suite).
# OMP_WAIT_POLICY=PASSIVE: a worker that waits at a barrier sleeps instead of spinning, so the
# shards' OpenMP threads do not spin on the cores that the other shards are computing on
# (spinning, the same two shards took 167 s).
in_shards() {
  local prefix=$1 n k status=0 pids=() claims
  shift
  claims=$(mktemp -d)
  n=$(nproc 2>/dev/null || echo 2)
  ((n < 2)) && n=2
  ((n > 4)) && n=4
  for ((k = 0; k < n; k++)); do
    env ATTNX_TEST_SHARD="$k/$n" ATTNX_TEST_CLAIMS="$claims" OMP_WAIT_POLICY=PASSIVE "$@" >"$prefix-$k.log" 2>&1 &
    pids+=($!)
  done
  for ((k = 0; k < n; k++)); do wait "${pids[$k]}" || status=1; done
  # Every shard collected the same tests, and between them they took every one.
  local claimed collected
  claimed=$(find "$claims" -type f -name "[0-9]*" | wc -l)
  collected=$(cat "$claims"/collected-* 2>/dev/null | sort -u | tr '\n' ' ')
  echo "tests: ${collected}collected by each of the $n shards, $claimed claimed between them"
  if [[ $collected != "$claimed " ]]; then
    echo "the shards' collections differ or a shard stopped early"
    status=1
  fi
  rm -rf "$claims"
  for ((k = 0; k < n; k++)); do
    echo "-- shard $k/$n"
    cat "$prefix-$k.log"
  done
  return "$status"
}
