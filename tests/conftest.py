"""Command-line options of the test suite (they must live in the top-level conftest)."""


def pytest_addoption(parser):
    parser.addoption("--transport", action="store", default=None,
                     help="comma-separated transports the transport contract suite runs "
                          "(default: every available one)")
