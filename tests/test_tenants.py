"""The router's tenants file: keys to tenants, groups to salts nobody can guess, and one clear line per mistake."""
import pytest

pytest.importorskip("yaml", reason="pyyaml is not installed")

from tiercache.errors import ConfigError  # noqa: E402
from tiercache.fleet.tenants import ANONYMOUS, Tenants, Unauthorized, group_salt  # noqa: E402


def _load(tmp_path, text: str) -> Tenants:
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    return Tenants.load(path)


def test_keys_map_to_tenants_and_groups_share_one_salt_that_is_not_the_groups_name(tmp_path):
    tenants = _load(tmp_path, "tenants:\n"
                              "  - {name: acme, api_keys: [sk-a1, sk-a2]}\n"
                              "  - {name: globex, api_keys: [sk-g], cache_group: acme}\n"
                              "  - {name: initech, api_keys: [sk-i]}\n")
    acme, also_acme, globex, initech = (tenants.authenticate(f"Bearer {k}") for k in ("sk-a1", "sk-a2", "sk-g", "sk-i"))
    assert acme.name == also_acme.name == "acme" and globex.name == "globex"
    assert acme.cache_salt == globex.cache_salt != initech.cache_salt
    assert "acme" not in acme.cache_salt and len(acme.cache_salt) == 64
    for header in (None, "", "Bearer", "Basic sk-a1", "Bearer sk-nobody"):
        with pytest.raises(Unauthorized):
            tenants.authenticate(header)
    assert Tenants().authenticate(None) is ANONYMOUS and not ANONYMOUS.cache_salt


def test_a_salt_secret_keeps_salts_across_key_rotations(tmp_path):
    before = _load(tmp_path, "salt_secret: a-secret-of-sixteen+\ntenants:\n  - {name: acme, api_keys: [sk-old]}\n")
    after = _load(tmp_path, "salt_secret: a-secret-of-sixteen+\ntenants:\n  - {name: acme, api_keys: [sk-new]}\n")
    assert before.authenticate("Bearer sk-old").cache_salt == after.authenticate("Bearer sk-new").cache_salt
    assert before.authenticate("Bearer sk-old").cache_salt == group_salt(b"a-secret-of-sixteen+", "acme")
    keyed = _load(tmp_path, "tenants:\n  - {name: acme, api_keys: [sk-new]}\n")
    assert keyed.authenticate("Bearer sk-new").cache_salt != after.authenticate("Bearer sk-new").cache_salt


@pytest.mark.parametrize("text, field", [
    ("tenants: []\n", "tenants"),
    ("tenants:\n  - {api_keys: [k]}\n", "tenants[0].name"),
    ("tenants:\n  - {name: a, api_keys: []}\n", "tenants[0].api_keys"),
    ("tenants:\n  - {name: a, api_keys: [k]}\n  - {name: a, api_keys: [j]}\n", "tenants[1].name"),
    ("tenants:\n  - {name: a, api_keys: [k]}\n  - {name: b, api_keys: [k]}\n", "tenants[1].api_keys"),
    ("tenants:\n  - {name: a, api_keys: [k], cache_group: 3}\n", "tenants[0].cache_group"),
    ("salt_secret: short\ntenants:\n  - {name: a, api_keys: [k]}\n", "salt_secret"),
    ("tenants: [unclosed\n", "--tenants"),
])
def test_a_bad_tenants_file_names_the_field(tmp_path, text, field):
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, text)
    assert field in str(err.value) and "\n" not in str(err.value)
