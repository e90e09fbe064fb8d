#!/usr/bin/env bash
# bench/ab-engine.sh -- engine-level A/B of two vouch binaries: `vouch bench` run by BASE and by NEW
# alternately, round by round, in one run on one machine, to show that a change costs nothing.
#
#   BASE=/work/base/target/release/vouch bench/ab-engine.sh                 # NEW = this tree, built first
#   BASE=/old/vouch NEW=/new/vouch REPS=9 bench/ab-engine.sh
#   BASE=... BENCH_ARGS="--interleave --configs raw,split,packed --guards crc32c --workloads randread,randwrite,seqwrite --repeat 1 --seconds 3" bench/ab-engine.sh
#
# Round r (1..REPS) runs `BASE bench BENCH_ARGS --size SIZE --json ...` then the same with NEW when r
# is odd, NEW then BASE when r is even (ABBA: neither binary always goes first). Each run writes its
# own JSON (`vouch bench --json`: every sample), so a round gives, per workload and configuration,
# one NEW and one BASE IOPS measured minutes apart at most. With --repeat N > 1 in BENCH_ARGS the
# value of a run is the median of its N inner repetitions.
#
# Report ($OUT/report.md, also printed): per workload and configuration the median IOPS of each
# binary, the per-round ratios NEW/BASE, their median (the verdict: flagged SLOWER when below
# THRESHOLD), the ratio of the medians, and for engine configurations the per-round ratio
# normalised by raw ((NEW cfg / NEW raw) / (BASE cfg / BASE raw), each from its own run: it removes
# device and machine drift between the two runs when raw is the same code in both binaries). The raw
# rows are the control: `raw` (a plain file) does not go through the engine, so its NEW/BASE
# spread is the noise floor of this machine at these settings. Exit status 3 when an engine row is
# flagged, 0 otherwise. Before trusting a flag, an A/A run (BASE=NEW=the same binary) at the same
# settings shows how far apart two identical binaries land here.
#
# Knobs (environment):
#   BASE        the old binary (required)
#   NEW         the new binary (default: $REPO/target/release/vouch, built first unless BUILD=0)
#   BUILD       1: cargo build --release -p vouch in this repository first (default 1 when NEW is
#               not given, else 0)
#   REPS        rounds (default 9)
#   BENCH_ARGS  arguments of every `vouch bench` run (default: the --direct target-run matrix with
#               --repeat 1 --seconds 3, see below); --size, --dir and --json are added by the script
#   SIZE        volume / file size per run (default 1GiB, vouch bench's default)
#   DIR         scratch directory (default /var/tmp/vouch-ab-engine): volumes under DIR/work,
#               removed on exit; OUT results (default DIR/results, overwritten each run)
#   THRESHOLD   flag level for NEW/BASE (default 0.95)
#   REPORT_ONLY 1: only rebuild OUT/report.md from OUT/json/*.json
#
# Output: $OUT/json/{base,new}-rNN.json (vouch bench --json), $OUT/logs/*.md (their tables),
#         $OUT/runs.tsv (order, time, load average of every run), $OUT/report.md.
ENV_KNOBS="BASE NEW BUILD REPS BENCH_ARGS SIZE DIR OUT THRESHOLD"
GIVEN_ENV=""
for _v in $ENV_KNOBS; do [ -n "${!_v+x}" ] && GIVEN_ENV+="$_v=${!_v} "; done
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BASE=${BASE:-}
if [ -z "${NEW:-}" ]; then NEW=$REPO/target/release/vouch; BUILD=${BUILD:-1}; else BUILD=${BUILD:-0}; fi
REPS=${REPS:-9}
BENCH_ARGS=${BENCH_ARGS:-"--direct --interleave --configs raw,split,packed --guards crc32c --workloads randread,randwrite --repeat 1 --seconds 3"}
SIZE=${SIZE:-1GiB}
DIR=${DIR:-/var/tmp/vouch-ab-engine}
OUT=${OUT:-$DIR/results}
THRESHOLD=${THRESHOLD:-0.95}
REPORT_ONLY=${REPORT_ONLY:-0}

set -u
export LC_ALL=C
CMDLINE="${GIVEN_ENV}$0${*:+ $*}"
WORK="$DIR/work"
REPORT="$OUT/report.md"

log() { printf '[%s] %s\n' "$(date +%T)" "$*" >&2; }
die() { log "FATAL: $*"; exit 1; }

CHILD=""
cleanup() {
    if [ -n "$CHILD" ] && kill -0 "$CHILD" 2>/dev/null; then
        kill -TERM "$CHILD" 2>/dev/null
        for _ in $(seq 300); do kill -0 "$CHILD" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$CHILD" 2>/dev/null
    fi
    rm -rf "$WORK" "$OUT/bin"
}

bin_facts() { # BINARY -> "path, sha256 prefix, --version, git commit of the tree it sits in (if any)"
    local b=$1 rev
    rev=$(git -C "$(dirname "$b")" rev-parse --short HEAD 2>/dev/null) \
        && { git -C "$(dirname "$b")" diff --quiet HEAD -- crates 2>/dev/null || rev+="+dirty"; }
    echo "\`$b\` (sha256 $(sha256sum "$b" | cut -c1-12), $("$b" --version 2>/dev/null | head -1)${rev:+, tree at $rev})"
}

make_report() {
    python3 - "$OUT" "$THRESHOLD" > "$REPORT" <<'PY'
import glob, json, os, re, statistics as st, sys
out, thr = sys.argv[1], float(sys.argv[2])
runs = {}   # (side, round) -> {(workload, config): value}
order = []  # (workload, config) in first-seen order
for path in sorted(glob.glob(os.path.join(out, "json", "*.json"))):
    m = re.match(r"(base|new)-r(\d+)\.json$", os.path.basename(path))
    if not m:
        continue
    try:
        j = json.load(open(path))
    except (OSError, ValueError) as e:
        print(f"<!-- skipped {path}: {e} -->")
        continue
    vals = {}
    for s in j.get("samples", []):
        k = (s["workload"], s["config"])
        if k not in order:
            order.append(k)
        vals.setdefault(k, []).append(float(s["iops"]))
    runs[(m.group(1), int(m.group(2)))] = {k: st.median(v) for k, v in vals.items()}
rounds = sorted({r for (_, r) in runs if ("base", r) in runs and ("new", r) in runs})
def fmt(x, d=0):
    return "-" if x is None or x != x else f"{x:,.{d}f}"
def med(v):
    return st.median(v) if v else float("nan")
P = print
P("# Engine A/B: `vouch bench`, NEW vs BASE (bench/ab-engine.sh)\n")
try:
    P(open(os.path.join(out, "facts.md")).read())
except OSError:
    pass
P(f"{len(rounds)} complete round(s) (one BASE and one NEW run each, order alternating). "
  "Value of a run = its IOPS (median of its inner repetitions); 1 MiB workloads are shown as MB/s "
  "(same ratios). `per round` = NEW/BASE of the same round, `med` = their median (the verdict; "
  f"**SLOWER** below {thr:.2f}), `min-max` their range, `med/med` = ratio of the medians, "
  "`vs raw` = median per-round ((NEW cfg/NEW raw)/(BASE cfg/BASE raw)). raw rows: the control "
  "(not engine code; their ratio shows the noise). A flagged row whose `vs raw` is fine moved with "
  "raw: machine drift between the runs is the first suspect (rerun, or more rounds).\n")
P("| workload | config | NEW | BASE | per round | med | min-max | med/med | vs raw | verdict |")
P("|---|---|---:|---:|---|---:|---|---:|---:|---|")
flags, control = [], []
for (w, c) in order:
    scale = 1.048576 if "-1m-" in w else 1.0   # 1 MiB requests: IOPS -> MB/s
    n = [runs[("new", r)].get((w, c)) for r in rounds]
    b = [runs[("base", r)].get((w, c)) for r in rounds]
    per = [x / y for x, y in zip(n, b) if x is not None and y]
    norm = []
    if c != "raw":
        for r in rounds:
            nn, bb = runs[("new", r)], runs[("base", r)]
            try:
                norm.append((nn[(w, c)] / nn[(w, "raw")]) / (bb[(w, c)] / bb[(w, "raw")]))
            except (KeyError, ZeroDivisionError, TypeError):
                pass
    mn = med([x for x in n if x is not None]); mb = med([x for x in b if x is not None])
    mr = med(per)
    if mr != mr:
        verdict = "-"
    elif c == "raw":
        verdict = "control"
        control.append(mr)
    elif mr < thr:
        verdict = f"**SLOWER** {mr:.3f}x"
        if norm and med(norm) >= thr:
            verdict += " (vs raw ok: drift?)"
        flags.append(f"{w} {c} {mr:.3f}x")
    else:
        verdict = "ok"
    unit = " MB/s" if scale != 1.0 else ""
    P(f"| {w} | {c} | {fmt(mn * scale)}{unit} | {fmt(mb * scale)}{unit} | "
      + " ".join(f"{x:.3f}" for x in per)
      + f" | {fmt(mr, 3)} | {fmt(min(per), 2) if per else '-'}-{fmt(max(per), 2) if per else '-'}"
      + f" | {fmt(mn / mb if mb else float('nan'), 3)} | {fmt(med(norm), 3) if norm else '-'} | {verdict} |")
P("")
if control:
    P(f"Control (raw, same code in both binaries): median NEW/BASE per workload "
      f"{min(control):.3f}-{max(control):.3f}x.\n")
if flags:
    P(f"**Verdict: {len(flags)} engine row(s) below {thr:.2f}x BASE:** " + "; ".join(flags) + "\n")
else:
    P(f"**Verdict: no engine row below {thr:.2f}x BASE** (median of per-round ratios, {len(rounds)} round(s)).\n")
sys.exit(3 if flags else 0)
PY
}

# ---------------------------------------------------------------- main
if [ "$REPORT_ONLY" = 1 ]; then
    ls "$OUT"/json/*.json >/dev/null 2>&1 || die "no $OUT/json/*.json"
    make_report; rc=$?; cat "$REPORT"; exit $rc
fi
[ -n "$BASE" ] || die "BASE=/path/to/old/vouch is required"
trap cleanup EXIT
trap 'exit 130' INT TERM HUP
mkdir -p "$DIR"
rm -rf "$OUT" "$WORK"; mkdir -p "$OUT/json" "$OUT/logs" "$OUT/bin" "$WORK"
if [ "$BUILD" = 1 ]; then
    log "cargo build --release -p vouch (in $REPO)"
    (cd "$REPO" && cargo build --release -p vouch) > "$OUT/logs/build.log" 2>&1 || die "build failed: see $OUT/logs/build.log"
fi
for side in base new; do
    b=$BASE; [ $side = new ] && b=$NEW
    [ -x "$b" ] || die "no vouch binary at $b ($side)"
    "$b" bench --help 2>/dev/null | grep -q -- '--json' || die "$b has no 'bench --json'"
done
{
    echo "- command: \`$CMDLINE\` (cwd $(pwd))"
    echo "- date: $(date -Is), host $(hostname); nproc $(nproc); $(grep -m1 '^model name' /proc/cpuinfo | sed 's/.*: //'); kernel $(uname -r)"
    echo "- directory: $WORK on $(findmnt -n -o FSTYPE,SOURCE -T "$DIR" | awk '{print $1" ("$2")"}')"
    echo "- NEW: $(bin_facts "$NEW")"
    echo "- BASE: $(bin_facts "$BASE")"
    echo "- each run: \`vouch bench $BENCH_ARGS --size $SIZE\`; REPS=$REPS"
} > "$OUT/facts.md"
cat "$OUT/facts.md" >&2
# snapshots: a rebuild during the run cannot change what is measured
cp "$BASE" "$OUT/bin/base" && cp "$NEW" "$OUT/bin/new" || die "cannot copy the binaries"
printf 'round\tpos\tside\tstart\tsecs\tload1\trc\n' > "$OUT/runs.tsv"
T0=$(date +%s)
read -r -a ARGS <<< "$BENCH_ARGS"
for r in $(seq "$REPS"); do
    if (( r % 2 )); then sides="base new"; else sides="new base"; fi
    pos=0
    for side in $sides; do
        pos=$((pos + 1))
        tag=$(printf '%s-r%02d' "$side" "$r")
        load1=$(cut -d' ' -f1 /proc/loadavg); t0=$(date +%s.%N)
        "$OUT/bin/$side" bench "${ARGS[@]}" --size "$SIZE" --dir "$WORK" --json "$OUT/json/$tag.json" \
            > "$OUT/logs/$tag.md" 2> "$OUT/logs/$tag.err" &
        CHILD=$!
        wait "$CHILD"; rc=$?; CHILD=""
        secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')
        printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$r" "$pos" "$side" "$(date -d "@${t0%.*}" +%T)" "$secs" "$load1" "$rc" >> "$OUT/runs.tsv"
        if [ $rc -ne 0 ]; then
            log "round $r/$REPS $side: rc=$rc (see $OUT/logs/$tag.err); its JSON is dropped"
            rm -f "$OUT/json/$tag.json"
        else
            log "round $r/$REPS $side: ${secs} s (load $load1)"
        fi
    done
done
log "done in $(( $(date +%s) - T0 )) s"
make_report; rc=$?
cat "$REPORT"
log "report: $REPORT"
exit $rc
