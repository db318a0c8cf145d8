import pytest


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One store shared by test_evaluate.py and test_export.py in a session: whichever runs second finds its
    upstream stages as store hits (both take their --set lists, IMDB and BILLSUM, from helpers.py)."""
    root = tmp_path_factory.getbasetemp() / "issue5-store"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FINETUNE_STORE", str(root))
        yield root
