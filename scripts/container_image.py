"""Build the container image with docker (when its daemon answers) or podman, on python:3.11-slim-bookworm or, where
no registry answers, on a Debian 12 base made here with mmdebstrap and imported (`make image`, `make image-test`).

    python3 scripts/container_image.py build [--tag cosyvoice-lite] [--base auto|official|debian|IMAGE]
    python3 scripts/container_image.py base          # the registry-free base: make it if missing, print its tag
    python3 scripts/container_image.py podman-conf   # write the podman settings below, print their path
    python3 scripts/container_image.py engine        # docker or podman

Standard library only (it runs before anything is installed); tests/test_image.py drives the same functions.
"""

from __future__ import annotations

import argparse
import configparser
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = "docker/Dockerfile"
IMAGE = "cosyvoice-lite"
OFFICIAL_BASE = "python:3.11-slim-bookworm"  # the Dockerfile's PYTHON_IMAGE default (tests/test_dockerfile.py checks)
CACHE = REPO / ".cache" / "container"  # git-ignored: the base's rootfs tar, the generated podman and pip settings
BASES = ("auto", "official", "debian")

# The registry-free base: Debian 12's own Python 3.11 (what python:3.11-slim-bookworm is built on), minbase.
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
DEBIAN_PACKAGES = ("python3", "python3-venv", "ca-certificates", "passwd")
MMDEBSTRAP_OPTIONS = (
    "--variant=minbase",
    "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",  # merged /usr without the usrmerge package and its perl (50 MB)
    "--dpkgopt=path-exclude=/usr/share/man/*",
    "--dpkgopt=path-exclude=/usr/share/info/*",
    "--dpkgopt=path-exclude=/usr/share/locale/*",
    "--dpkgopt=path-exclude=/usr/share/doc/*",
    "--dpkgopt=path-include=/usr/share/doc/*/copyright",
)
# A fixed date for every file and the image: the same packages give the same tar and the same base image id, so
# the build's layer cache stays valid from one base to the next.
SOURCE_DATE_EPOCH = "1700000000"
IMPORT_CHANGES = ("ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "ENV LANG=C.UTF-8", 'CMD ["python3"]')
# Where Debian (and so both bases) keep the CA bundle; Debian's pip reads it, upstream pip needs `cert` in pip.conf.
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
PIP_INDEX_KEYS = ("index-url", "extra-index-url", "trusted-host")


class ImageError(Exception):
    """A step of building the image failed; the message is one line for the user."""


def run(argv: Sequence[str], env: Mapping[str, str] | None = None, timeout_s: float = 1800) -> str:
    """Run a command, return its stdout; ImageError with the last line of its stderr when it fails."""
    try:
        done = subprocess.run(list(argv), env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ImageError(f"{argv[0]} {argv[1]}: {e}") from e
    if done.returncode != 0:
        last = (done.stderr.strip() or done.stdout.strip() or f"exit status {done.returncode}").splitlines()[-1]
        raise ImageError(f"{' '.join(argv[:2])} failed: {last}")
    return done.stdout


def docker_daemon_answers() -> bool:
    if not shutil.which("docker"):
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def pick_engine() -> str:
    """CONTAINER_ENGINE when set, else docker when its daemon answers, else podman."""
    chosen = os.environ.get("CONTAINER_ENGINE", "")
    if chosen:
        if chosen not in ("docker", "podman"):
            raise ImageError(f"CONTAINER_ENGINE must be docker or podman, not {chosen!r}")
        return chosen
    if docker_daemon_answers():
        return "docker"
    if shutil.which("podman"):
        return "podman"
    raise ImageError("no container engine: no docker daemon answers and podman is not installed (apt-get install podman runc)")


def podman_conf() -> str:
    """containers.conf for hosts like the CI VM, safe on others: runc (crun 1.8 refuses a hybrid cgroup v1/v2 layout),
    ulimits the engine may set (raising a hard limit needs CAP_SYS_RESOURCE), cgroupfs and a file event log (no
    systemd, no journald needed)."""
    limits = []
    for name, limit in (("nofile", resource.RLIMIT_NOFILE), ("nproc", resource.RLIMIT_NPROC)):
        hard = resource.getrlimit(limit)[1]
        if name == "nproc":  # podman 4.3 runs with nproc at most kernel.pid_max (seen: 32768, the shell's: 96365)
            hard = _pid_max() if hard == resource.RLIM_INFINITY else min(hard, _pid_max())
        if hard != resource.RLIM_INFINITY:
            limits.append(f"{name}={hard}:{hard}")
    engine = ['cgroup_manager = "cgroupfs"', 'events_logger = "file"'] + (['runtime = "runc"'] if shutil.which("runc") else [])
    return "\n".join(["[containers]", f"default_ulimits = {json.dumps(limits)}", "", "[engine]", *engine, ""])


def _pid_max() -> int:
    return int(Path("/proc/sys/kernel/pid_max").read_text(encoding="utf-8"))


def write_podman_conf() -> Path:
    return _write_cached("containers.conf", podman_conf())


def engine_env(engine: str) -> dict[str, str]:
    """The environment to run `engine` in: podman gets the settings above unless CONTAINERS_CONF names others."""
    env = dict(os.environ)
    if engine == "podman" and not env.get("CONTAINERS_CONF"):
        env["CONTAINERS_CONF"] = str(write_podman_conf())
    return env


def _write_cached(name: str, text: str) -> Path:
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / name
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")
    return path


def image_id(engine: str, ref: str, env: Mapping[str, str]) -> str | None:
    """The id of a local image, None when the engine's store does not hold it."""
    done = subprocess.run([engine, "image", "inspect", "--format", "{{.Id}}", ref], env=env, capture_output=True, text=True)
    found = done.stdout.strip() if done.returncode == 0 else ""
    return found or None


def debian_base_tag() -> str:
    """The base's tag, keyed by everything that makes it: a changed recipe is a new base, never a stale one."""
    recipe = [DEBIAN_SUITE, DEBIAN_MIRROR, *DEBIAN_PACKAGES, *MMDEBSTRAP_OPTIONS, SOURCE_DATE_EPOCH, *IMPORT_CHANGES]
    key = hashlib.sha256(json.dumps(recipe).encode()).hexdigest()[:12]
    return f"localhost/{IMAGE}-base:{DEBIAN_SUITE}-{key}"


def mmdebstrap_argv(out: Path) -> list[str]:
    packages = f"--include={','.join(DEBIAN_PACKAGES)}"
    return ["mmdebstrap", "--quiet", *MMDEBSTRAP_OPTIONS, packages, DEBIAN_SUITE, str(out), DEBIAN_MIRROR]


def debian_base(engine: str, env: Mapping[str, str]) -> str:
    """Tag of the registry-free base in the engine's store: imported from the cached rootfs tar, which mmdebstrap
    makes when it is missing (1-2 min: about 45 packages from the Debian mirror)."""
    tag = debian_base_tag()
    if image_id(engine, tag, env):
        return tag
    tar = CACHE / f"{tag.rsplit(':', 1)[1]}.tar"
    if not tar.is_file():
        if not shutil.which("mmdebstrap"):
            raise ImageError("the registry-free base needs mmdebstrap (apt-get install mmdebstrap)")
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=CACHE) as scratch:
            partial, log = Path(scratch) / "rootfs.tar", CACHE / "mmdebstrap.log"
            with log.open("w", encoding="utf-8") as out:  # stdin closed: mmdebstrap reads apt sources from a pipe
                done = subprocess.run(
                    mmdebstrap_argv(partial),
                    env={**env, "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH},
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            if done.returncode != 0:
                raise ImageError(f"mmdebstrap failed (exit status {done.returncode}); see {log}")
            partial.replace(tar)
    changes = [arg for change in IMPORT_CHANGES for arg in ("--change", change)]
    run([engine, "import", *changes, str(tar), tag], env)
    return tag


def host_ca_bundle() -> Path | None:
    """The CA bundle this host's pip and Python trust (a TLS-intercepting proxy's CA is in it, when there is one)."""
    for name in ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
        value = os.environ.get(name, "")
        if value and Path(value).is_file():
            return Path(value)
    return Path(CA_BUNDLE) if Path(CA_BUNDLE).is_file() else None


def host_pip_indexes() -> dict[str, str]:
    """index-url, extra-index-url and trusted-host of this host's pip configuration (its files, then PIP_* variables,
    as pip reads them), keeping only http(s) indexes: a local file:// index or directory is not there in the build."""
    config_home = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    files = [Path("/etc/xdg/pip/pip.conf"), Path("/etc/pip.conf"), Path.home() / ".pip/pip.conf", config_home / "pip/pip.conf"]
    files += [Path(os.environ["PIP_CONFIG_FILE"])] if os.environ.get("PIP_CONFIG_FILE") else []
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(files, encoding="utf-8")
    found = {}
    for key in PIP_INDEX_KEYS:
        from_files = parser.get("install", key, fallback=None) or parser.get("global", key, fallback=None)
        value = os.environ.get("PIP_" + key.upper().replace("-", "_")) or from_files or ""
        kept = [v for v in value.split() if key == "trusted-host" or urlparse(v).scheme in ("http", "https")]
        if kept:
            found[key] = " ".join(kept)
    return found


def pip_mounts(official_pip: bool) -> list[str]:
    """podman build --volume arguments that let pip in the build use this host's CA bundle and package indexes.

    The CA bundle is mounted over the base's own (an existing file: nothing is left in the image). pip.conf is
    mounted only when it has something to say (remote indexes; `cert` for upstream pip, which ignores the system
    bundle): buildah leaves an empty /etc/pip.conf behind as the mount point.
    """
    ca = host_ca_bundle()
    mounts = ["--volume", f"{ca}:{CA_BUNDLE}:ro"] if ca else []
    settings = host_pip_indexes() | ({"cert": CA_BUNDLE} if ca and official_pip else {})
    if settings:
        conf = _write_cached("pip.conf", "[global]\n" + "".join(f"{k} = {v}\n" for k, v in sorted(settings.items())))
        mounts += ["--volume", f"{conf}:/etc/pip.conf:ro"]
    return mounts


def build_argv(engine: str, tag: str, python_image: str | None = None, extra: Sequence[str] = ()) -> list[str]:
    """The build command: `--format docker` on podman (its OCI default drops HEALTHCHECK, with a warning)."""
    argv = [engine, "build", *(["--format", "docker"] if engine == "podman" else []), "-f", DOCKERFILE, "-t", tag]
    argv += ["--build-arg", f"PYTHON_IMAGE={python_image}"] if python_image else []
    return [*argv, *extra, "."]


def run_argv(
    engine: str,
    image: str,
    name: str = "tts",
    volume: str = "tts-data",
    ports: tuple[str, str] = ("8000", "50000"),
    user: str | None = None,
) -> list[str]:
    """How the image is meant to run (docs/deployment.md's command): detached, HTTP and gRPC published, read-only root with
    a tmpfs /tmp (jieba's dictionary cache) and saved voices on a volume. `ports` are host ports or host:port."""
    argv = [engine, "run", "-d", "--name", name, "-p", f"{ports[0]}:8000", "-p", f"{ports[1]}:50000"]
    argv += ["--read-only", "--tmpfs", "/tmp"]  # noqa: S108 (a tmpfs inside the container)
    argv += ["-v", f"{volume}:/app/data", *(["--user", user] if user else [])]
    return [*argv, image]


def stop_argv(engine: str, name: str = "tts") -> list[str]:
    """SIGTERM, then up to 30 s for the drain (TTS_DRAIN_TIMEOUT_S, 10 s by default) before SIGKILL."""
    return [engine, "stop", "-t", "30", name]


def resolve_base(engine: str, base: str, env: Mapping[str, str]) -> str | None:
    """The PYTHON_IMAGE to build on (None: the Dockerfile's default). `auto`: the official base when the store has it
    or a registry gives it, else the Debian one (said on stderr)."""
    if base == "debian":
        return debian_base(engine, env)
    if base not in ("auto", "official"):
        return base
    if image_id(engine, OFFICIAL_BASE, env):
        return None
    try:
        run([engine, "pull", "-q", OFFICIAL_BASE], env, timeout_s=600)
        return None
    except ImageError as e:
        if base == "official":
            raise ImageError(f"{e} (no registry? `make image BASE=debian` builds without one)") from e
        print(f"container_image: {OFFICIAL_BASE} is not available ({e}); building on the Debian base", file=sys.stderr)
        return debian_base(engine, env)


def build(engine: str, tag: str, python_image: str | None = None, log: Path | None = None) -> str:
    """Build docker/Dockerfile (MODEL=tiny) on `python_image` (None: the Dockerfile's default) as `tag`; return the
    image id. The build's output goes to `log`, else to the terminal."""
    env = engine_env(engine)
    with tempfile.TemporaryDirectory() as scratch:
        iidfile = Path(scratch) / "iid"
        extra = ["--iidfile", str(iidfile)]
        if engine == "podman":  # docker build has no --volume; a daemon behind a proxy is set up on the daemon
            extra += pip_mounts(official_pip=python_image is None)
        argv = build_argv(engine, tag, python_image, extra)
        if log is None:
            done = subprocess.run(argv, env=env, cwd=REPO)
        else:
            with log.open("w", encoding="utf-8") as out:
                done = subprocess.run(argv, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            raise ImageError(f"{engine} build failed (exit status {done.returncode})" + (f"; see {log}" if log else ""))
        return iidfile.read_text(encoding="utf-8").strip()


def image_size_bytes(engine: str, ref: str, env: Mapping[str, str]) -> int:
    return int(run([engine, "image", "inspect", "--format", "{{.Size}}", ref], env).strip())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    made = sub.add_parser("build", help="build docker/Dockerfile")
    made.add_argument("--tag", default=IMAGE)
    made.add_argument("--base", default="auto", help="auto, official, debian or an image reference (default: auto)")
    for name in ("base", "podman-conf", "engine"):
        sub.add_parser(name)
    args = parser.parse_args(argv)
    try:
        if args.command == "podman-conf":
            print(write_podman_conf())
            return 0
        engine = pick_engine()
        if args.command == "engine":
            print(engine)
        elif args.command == "base":
            print(debian_base(engine, engine_env(engine)))
        else:
            python_image = resolve_base(engine, args.base, engine_env(engine))
            built = build(engine, args.tag, python_image)
            size_mb = image_size_bytes(engine, built, engine_env(engine)) / 1e6
            short = built.removeprefix("sha256:")[:12]
            print(f"{args.tag}: {short} built with {engine} on {python_image or OFFICIAL_BASE}, {size_mb:.0f} MB")
    except ImageError as e:
        print(f"container_image: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
