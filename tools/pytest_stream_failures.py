"""A pytest plugin (tools/upstream_tests.sh loads it with -p): prints each failure's
report as soon as the test ends, not at the end of the session, so that a run cut off
by a timeout still says why its tests failed, and the time of each test that passed in
a second or more (the junit files, which hold every time, are written only at the end)."""


def pytest_runtest_logreport(report):
    if report.failed:
        text = report.longreprtext
        if len(text) > 4000:
            text = "...\n" + text[-4000:]
        print(f"\n--- {report.nodeid} failed in {report.when} ({report.duration:.1f} s):\n{text}\n",
              flush=True)
    elif report.when == "call" and report.passed and report.duration >= 1.0:
        print(f"\n--- {report.nodeid} passed in {report.duration:.1f} s\n", flush=True)
