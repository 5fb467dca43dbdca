"""Session-wide fixtures live in tests/fixtures/*; each module is one shared resource."""

pytest_plugins = [
    "tests.fixtures.s3",
]
