"""Per-test results and counts from pytest junit files (tools/upstream_tests.sh).

    python tools/junit_summary.py OUT/*.xml                 one line per test, then counts
    python tools/junit_summary.py --compare PEER_DIR OUR_DIR  tests that pass on the peer
                                                             and not on ours
"""
import collections
import glob
import os
import sys
import xml.etree.ElementTree as ET


def results(path):
    """{test name: 'passed' | 'failed' | 'error' | 'skipped'} of one junit file."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name")
        if case.get("classname"):
            name = case.get("classname").rsplit(".", 1)[-1] + "::" + name
        state = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                state = {"failure": "failed"}.get(child.tag, child.tag)
        out[name] = state
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


def compare(peer_dir, our_dir):
    """Exit 1 if a test passes on the peer and not on ours (same junit file name)."""
    worse = 0
    for peer in sorted(glob.glob(os.path.join(peer_dir, "*.xml"))):
        ours = os.path.join(our_dir, os.path.basename(peer))
        theirs = results(peer)
        mine = results(ours) if os.path.exists(ours) else {}
        for name, state in sorted(theirs.items()):
            if state == "passed" and mine.get(name) != "passed":
                print(f"{tag(peer)}  {name}  peer passed, ours {mine.get(name, 'missing')}")
                worse += 1
        print(f"{tag(peer)}: peer {sum(s == 'passed' for s in theirs.values())} passed, "
              f"ours {sum(s == 'passed' for s in mine.values())} passed")
    return 1 if worse else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    summary(sys.argv[1:])
