import pytest

import thinkspec


def test_version_and_lazy_exports():
    assert thinkspec.__version__.count(".") == 2
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        thinkspec.Nope  # noqa: B018
