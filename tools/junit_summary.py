"""Per-test results and counts from pytest junit files (tools/upstream_tests.sh).

    python tools/junit_summary.py OUT/*.xml                 one line per test, then counts
    python tools/junit_summary.py --compare PEER_DIR OUR_DIR  tests that pass on the peer
                                                             and not on ours, and tests that
                                                             took over twice the peer's time
    python tools/junit_summary.py --table PEER_DIR OUR_DIR    the same as a Markdown table,
                                                             one row per test (docs/compat.md)
"""
import collections
import glob
import os
import sys
import xml.etree.ElementTree as ET


# Below this many seconds of difference a test is not called slower than the peer's:
# pytest's own per-test overhead and process-level noise are of that order.
SLOWER_FLOOR_S = 1.0


def results(path):
    """{test name: 'passed' | 'failed' | 'error' | 'skipped'} of one junit file."""
    return {name: state for name, (state, _) in timed_results(path).items()}


def timed_results(path):
    """{test name: (state, seconds)} of one junit file."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name") or "(unnamed)"
        if case.get("classname"):
            name = case.get("classname").rsplit(".", 1)[-1] + "::" + name
        state = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                state = {"failure": "failed"}.get(child.tag, child.tag)
        out[name] = (state, float(case.get("time") or 0.0))
    return out


def tag(path):
    return os.path.basename(path)[:-len(".xml")]


def summary(paths):
    for path in sorted(paths):
        res = results(path)
        for name, state in sorted(res.items()):
            if state != "passed":
                print(f"{tag(path)}  {name}  {state.upper()}")
        counts = collections.Counter(res.values())
        print(f"{tag(path)}: " + ", ".join(f"{counts[s]} {s}" for s in
                                           ("passed", "failed", "error", "skipped")))


def pairs(peer_dir, our_dir):
    """(file tag, {test: (peer state, peer s)}, {test: (our state, our s)}) per peer file."""
    for peer in sorted(glob.glob(os.path.join(peer_dir, "*.xml"))):
        ours = os.path.join(our_dir, os.path.basename(peer))
        yield (tag(peer), timed_results(peer),
               timed_results(ours) if os.path.exists(ours) else {})


def slower(peer_s, our_s):
    return our_s > 2 * peer_s and our_s - peer_s > SLOWER_FLOOR_S


def compare(peer_dir, our_dir):
    """Exit 1 if a test passes on the peer and not on ours (same junit file name), or
    passes on both and took ours over twice the peer's time (and SLOWER_FLOOR_S more)."""
    worse = 0
    for name_, theirs, mine in pairs(peer_dir, our_dir):
        total_p = total_o = 0.0
        for name, (state, secs) in sorted(theirs.items()):
            our_state, our_secs = mine.get(name, ("missing", 0.0))
            total_p, total_o = total_p + secs, total_o + our_secs
            if state == "passed" and our_state != "passed":
                print(f"{name_}  {name}  peer passed, ours {our_state}")
                worse += 1
            elif state == our_state == "passed" and slower(secs, our_secs):
                print(f"{name_}  {name}  ours took {our_secs:.2f} s, peer {secs:.2f} s")
                worse += 1
        for name in sorted(set(mine) - set(theirs)):
            print(f"{name_}  {name}  not run on the peer (ours {mine[name][0]})")
        print(f"{name_}: peer {sum(s == 'passed' for s, _ in theirs.values())} passed "
              f"in {total_p:.0f} s, ours {sum(s == 'passed' for s, _ in mine.values())} "
              f"passed in {total_o:.0f} s")
    return 1 if worse else 0


def table(peer_dir, our_dir):
    """Markdown: one row per test of each file, the peer's state and time beside ours."""
    for name_, theirs, mine in pairs(peer_dir, our_dir):
        print(f"\n`{name_}`\n")
        print("| test | upstream | s | ours | s |")
        print("| --- | --- | ---: | --- | ---: |")
        for name in sorted(set(theirs) | set(mine)):
            ps, pt = theirs.get(name, ("missing", 0.0))
            os_, ot = mine.get(name, ("missing", 0.0))
            print(f"| {name.split('::')[-1]} | {ps} | {pt:.2f} | {os_} | {ot:.2f} |")


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1].startswith("-") and sys.argv[1] not in (
            "--compare", "--table"):
        print(__doc__)
        sys.exit(0 if sys.argv[1:] in (["-h"], ["--help"]) else 2)
    if len(sys.argv) == 4 and sys.argv[1] == "--compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    if len(sys.argv) == 4 and sys.argv[1] == "--table":
        sys.exit(table(sys.argv[2], sys.argv[3]))
    summary(sys.argv[1:])
