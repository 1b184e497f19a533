#!/usr/bin/env bash
# Installs, idempotently, what the tests need from Debian: Prometheus (with promtool),
# Alertmanager (with amtool), a Java 17+ runtime, Maven, openssl and Chromium. Python packages live in
# the project's virtualenv (see the Makefile); Kafka's jars come from Maven Central.
set -euo pipefail

need=()
command -v prometheus >/dev/null || need+=(prometheus)
command -v promtool >/dev/null || need+=(prometheus)
command -v prometheus-alertmanager >/dev/null || need+=(prometheus-alertmanager)
command -v amtool >/dev/null || need+=(prometheus-alertmanager)
command -v java >/dev/null || need+=(openjdk-17-jre-headless)
command -v mvn >/dev/null || need+=(maven)
command -v openssl >/dev/null || need+=(openssl)  # the TLS test makes a certificate
command -v chromium >/dev/null || need+=(chromium)  # the triage page's browser test (driven by playwright)

if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "need root or sudo to install: ${need[*]}" >&2; exit 1; }
  sudo="sudo"
fi
echo "installing Debian packages: ${need[*]}" >&2
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
