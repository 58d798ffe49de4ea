"""The test suite, a package so that tests and the scripts they run import shared helpers by
their place: ``from tests.helpers import tiny_config``, ``from tests.embedding.reference_checks
import check_against_reference`` (docs/testing.md)."""
