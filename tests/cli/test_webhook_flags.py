"""`gpudra webhook` flags that change what the webhook writes and checks: the driver name,
the shared class's strategy, time-slice interval and MPS defaults reach the conversion
policy, so converted claims and validation agree with the DeviceClasses and node agent."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path
from typing import Any

import pytest
from gpudra.cli.main import build_parser
from gpudra.cli.webhook import conversion_policy, quota_leader, run, server_config
from gpudra.webhook.convert import ConversionPolicy, convert_pod
from gpudra.webhook.transport import HttpConfig
from gpudra.webhook.validate import driver_classes, validate_claim_object


def policy(*flags: str) -> ConversionPolicy:
    return conversion_policy(build_parser().parse_args(["webhook", "--cert-dir=certs", *flags]))


def pod(resource: str) -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {resource: "1"}}}]},
    }


def template_spec(conversion_policy: ConversionPolicy, resource: str) -> dict[str, Any]:
    (template,) = convert_pod(pod(resource), conversion_policy).templates
    spec: dict[str, Any] = template["spec"]["spec"]
    return spec


def shared_sharing(conversion_policy: ConversionPolicy) -> dict[str, Any]:
    (entry,) = template_spec(conversion_policy, "nvidia.com/gpu.shared")["devices"]["config"]
    sharing: dict[str, Any] = entry["opaque"]["parameters"]["sharing"]
    return sharing


def test_defaults_are_the_upstream_driver_and_time_slicing() -> None:
    assert policy() == ConversionPolicy()


def test_driver_name_reaches_mig_selectors_and_configs() -> None:
    custom = policy("--driver-name=gpu.example.com")
    (request,) = template_spec(custom, "nvidia.com/mig-1g.10gb")["devices"]["requests"]
    (selector,) = request["exactly"]["selectors"]
    assert selector["cel"]["expression"] == (
        'device.attributes["gpu.example.com"].profile == "1g.10gb"'
    )
    (entry,) = template_spec(custom, "nvidia.com/gpu.shared")["devices"]["config"]
    assert entry["opaque"]["driver"] == "gpu.example.com"


def test_mig_profile_classes_reach_converted_claims_and_validation() -> None:
    custom = policy("--mig-profile-class=1g.10gb")
    (request,) = template_spec(custom, "nvidia.com/mig-1g.10gb")["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == "mig-1g.10gb.nvidia.com"
    (request,) = template_spec(custom, "nvidia.com/mig-3g.40gb")["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == "mig.nvidia.com"
    assert "mig-1g.10gb.nvidia.com" in driver_classes(custom)


def test_driver_name_reaches_config_validation() -> None:
    bad = {
        "metadata": {"name": "c", "namespace": "ns"},
        "spec": {
            "devices": {
                "requests": [{"name": "r", "exactly": {"deviceClassName": "gpu.nvidia.com"}}],
                "config": [
                    {
                        "opaque": {
                            "driver": "gpu.example.com",
                            "parameters": {"apiVersion": "resource.nvidia.com/v1beta1"},
                        }
                    }
                ],
            }
        },
    }

    def verdict(p: ConversionPolicy) -> bool:
        return validate_claim_object(
            bad, template=False, policy=p, classes=driver_classes(p), rules=None
        ).allowed

    assert verdict(policy())  # another driver's config: not ours to judge
    assert not verdict(policy("--driver-name=gpu.example.com"))


def test_shared_strategy_mps_replaces_the_time_slicing_config() -> None:
    assert shared_sharing(policy()) == {
        "strategy": "TimeSlicing",
        "timeSlicingConfig": {"interval": "Default"},
    }
    assert shared_sharing(policy("--shared-strategy=MPS")) == {"strategy": "MPS"}


def test_time_slice_interval_reaches_converted_claims() -> None:
    sharing = shared_sharing(policy("--time-slice-interval=Long"))
    assert sharing["timeSlicingConfig"] == {"interval": "Long"}


def test_mps_defaults_reach_converted_claims() -> None:
    """A converted claim's config replaces the class's: it must carry the defaults."""
    sharing = shared_sharing(
        policy(
            "--shared-strategy=MPS",
            "--mps-default-active-thread-percentage=25",
            "--mps-default-pinned-device-memory-limit=10Gi",
        )
    )
    assert sharing["mpsConfig"] == {
        "defaultActiveThreadPercentage": 25,
        "defaultPinnedDeviceMemoryLimit": "10Gi",
    }


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--driver-name=GPU"], "--driver-name 'GPU' must be a DNS subdomain"),
        (["--driver-name=" + "a." * 32 + "io"], "at most 63 characters"),
        (
            ["--mps-default-active-thread-percentage=20"],
            "MPS settings apply only with --shared-strategy=MPS",
        ),
        (
            ["--shared-strategy=MPS", "--mps-default-active-thread-percentage=500"],
            "--mps-default-active-thread-percentage 500: must be between",
        ),
        (
            ["--shared-strategy=MPS", "--mps-default-pinned-device-memory-limit=lots"],
            "--mps-default-pinned-device-memory-limit 'lots': 'lots' is not a quantity",
        ),
        (
            ["--mig-profile-class=1g.10gb", "--mig-profile-class=mig-3g.40gb"],
            "--mig-profile-class: 'mig-3g.40gb' is not a MIG profile",
        ),
        (
            ["--extended-resource-name=example.com/gpu"],
            "--extended-resource-name 'example.com/gpu' is not a device-plugin resource",
        ),
    ],
)
def test_bad_values_name_the_flag(flags: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match="gpudra webhook: ") as exit_:
        policy(*flags)
    assert message in str(exit_.value)


@pytest.mark.parametrize("flag", ["--shared-strategy=Spatial", "--time-slice-interval=Forever"])
def test_choices_are_the_drivers(flag: str) -> None:
    with pytest.raises(SystemExit):
        policy(flag)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ca-dir=ca"], "--ca-dir and --cert-source=ca go together"),
        (["--cert-source=ca"], "--ca-dir and --cert-source=ca go together"),
        (["--cert-source=ca", "--ca-dir={tmp}"], "--ca-dir: {tmp} has no ca.crt or ca.key"),
        (["--client-ca-file=ca.crt"], "--client-ca-file and --health-port go together"),
        (["--health-port=8444"], "--client-ca-file and --health-port go together"),
        (
            ["--client-ca-file=ca.crt", "--health-port=8443"],
            "--health-port 8443 must be 1-65535 and differ from --port 8443",
        ),
        (["--client-cert-name=kube-apiserver"], "--client-cert-name needs --client-ca-file"),
        (
            ["--client-ca-file=ca.crt", "--health-port=8444", "--client-cert-name= x"],
            "--client-cert-name ' x': give the common name or DNS name",
        ),
    ],
)
def test_certificate_flags_that_go_together(tmp_path: Path, flags: list[str], message: str) -> None:
    args = [f.format(tmp=tmp_path) for f in flags]
    parsed = build_parser().parse_args(["webhook", f"--cert-dir={tmp_path / 'serving'}", *args])
    with pytest.raises(SystemExit) as exit_:
        run(parsed)
    assert message.format(tmp=tmp_path) in str(exit_.value)


def test_tenant_rules_are_refused_without_claim_validation(tmp_path: Path) -> None:
    """Tenant rules on classes, sharing and MIG profiles are judged on each claim and
    template as it is created: without claim validation they would not hold."""
    parser = build_parser()
    args = parser.parse_args(["webhook", f"--cert-dir={tmp_path}", "--no-validate-claims"])
    with pytest.raises(SystemExit) as exit_:
        run(args)
    assert "--tenants needs --validate-claims" in str(exit_.value)
    assert not any(tmp_path.iterdir())  # refused before any certificate was made


@pytest.mark.parametrize("flag", ["--device-c=l4.example.com", "--no-validate=x"])
def test_flags_are_taken_spelt_out_in_full_only(flag: str) -> None:
    """Manifests and the chart's checks name flags in full; an abbreviation argparse
    would take (`--device-c` for `--device-class`) would get past such a check."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["webhook", "--cert-dir=c", flag])


def test_max_connections_reaches_the_server_and_must_be_positive(tmp_path: Path) -> None:
    parser = build_parser()

    def config(*flags: str) -> HttpConfig:
        args = parser.parse_args(["webhook", "--cert-dir=certs", *flags])
        return server_config(args, conversion_policy(args))

    assert config().max_connections == HttpConfig.max_connections == 1024
    assert config("--max-connections=4096").max_connections == 4096
    args = parser.parse_args(["webhook", f"--cert-dir={tmp_path}", "--max-connections=0"])
    with pytest.raises(SystemExit) as exit_:
        run(args)
    assert "gpudra webhook: --max-connections 0: give at least 1" in str(exit_.value)
    assert not any(tmp_path.iterdir())  # refused before any certificate was made


def test_conversion_namespace_selector_is_a_checked_label_selector(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_parser()
    raw = '{"matchExpressions":[{"key":"team","operator":"Exists"}]}'
    args = parser.parse_args(["webhook", "--cert-dir=c", f"--conversion-namespace-selector={raw}"])
    assert args.conversion_namespace_selector == {
        "matchExpressions": [{"key": "team", "operator": "Exists"}]
    }
    with pytest.raises(SystemExit):
        parser.parse_args(
            [
                "webhook",
                "--cert-dir=c",
                '--conversion-namespace-selector={"matchExpressions":[{"key":"t","operator":"In"}]}',
            ]
        )
    err = capsys.readouterr().err
    assert "--conversion-namespace-selector: matchExpressions.0:" in err
    assert "operator In needs a non-empty values list" in err


@pytest.mark.parametrize("name", ["A100_80GB", "x" * 226 + ".io"])
def test_a_device_class_that_would_make_no_quota_key_is_refused_at_start(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An admin's class is limited in every tenant's quota: a name that is no valid
    quota key would fail each quota's write and so, quota not in place, every GPU pod
    of those namespaces; the flag is refused instead, naming it."""
    with pytest.raises(SystemExit):
        policy(f"--device-class={name}")
    assert "argument --device-class" in capsys.readouterr().err
    assert policy("--device-class=a100-80gb.example.com") is not None


def test_the_quota_writer_is_elected_on_the_pods_name_in_the_webhooks_namespace(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("POD_NAME", "gpudra-webhook-7d9f-x2x4z")

    def parse(*flags: str) -> argparse.Namespace:
        return build_parser().parse_args(["webhook", "--cert-dir=certs", *flags])

    leader = quota_leader(parse("--namespace=gpu-system"), None)  # type: ignore[arg-type]
    assert leader is not None
    assert (leader.name, leader.namespace) == ("gpudra-webhook-tenant-quotas", "gpu-system")
    assert leader.identity == "gpudra-webhook-7d9f-x2x4z"
    monkeypatch.delenv("POD_NAME")
    # Two webhooks on one host are two candidates, not one.
    host = [quota_leader(parse(), None) for _ in range(2)]  # type: ignore[arg-type]
    identities = {e.identity for e in host if e is not None}
    assert len(identities) == 2
    assert all(i.startswith(f"{socket.gethostname()}_") for i in identities)
    assert quota_leader(parse("--no-leader-elect"), None) is None  # type: ignore[arg-type]
    assert quota_leader(parse("--no-tenants"), None) is None  # type: ignore[arg-type]
    with pytest.raises(SystemExit):
        parse("--leader-elect-lease-name=Not_A_Name")
    assert "--leader-elect-lease-name: 'Not_A_Name'" in capsys.readouterr().err


@pytest.mark.parametrize("raw", ["-1", "nan", "inf", "21", "five"])
def test_a_shutdown_delay_out_of_range_is_refused_naming_the_bounds(
    raw: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["webhook", "--cert-dir=certs", f"--shutdown-delay={raw}"])
    assert "give seconds from 0 to 20" in capsys.readouterr().err


def test_the_shutdown_delay_defaults_to_a_few_seconds() -> None:
    assert build_parser().parse_args(["webhook", "--cert-dir=certs"]).shutdown_delay == 5
    flags = ["webhook", "--cert-dir=certs", "--shutdown-delay=0"]
    assert build_parser().parse_args(flags).shutdown_delay == 0
