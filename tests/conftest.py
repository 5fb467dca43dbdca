"""Session-wide fixtures live in tests/fixtures/*; each module is one shared resource."""

pytest_plugins = ["tests.fixtures.ray_cluster", "tests.fixtures.s3"]
