"""Test and demo doubles of what AWS provides a node (the fake IMDS). Never imported by the
agent's production code (tests/test_import_contract.py checks it)."""
