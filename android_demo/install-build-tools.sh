#!/usr/bin/env bash
# Installs, from Debian and npm, what android_demo/build_apk.py (the APK without Gradle) and
# the Kotlin half of tests/test_android_demo.py need; run as root (apt). Does nothing for what
# is installed already, so a second run costs a second.
#
#   Debian, this release:   aapt (aapt and aapt2), zipalign, apksigner, libandroid-json-java
#                           (org.json for the host JVM), a JDK (javac, keytool)
#   Debian 11 (bullseye):   android-sdk-platform-23 (android.jar, API 23), dalvik-exchange (dx):
#                           no later Debian release has them. Its source is added on the mirror
#                           this machine already uses, pinned so that only what is asked for by
#                           name comes from it (nothing installed is ever upgraded from it).
#   npm:                    kotlin-compiler (JetBrains' kotlinc)
#
# Downloads stay cached (apt's /var/cache/apt/archives, npm's ~/.npm) for a reinstall.
set -euo pipefail

KOTLIN_COMPILER=kotlin-compiler@2.4.20
BULLSEYE_SOURCE=/etc/apt/sources.list.d/mtp-edge-bullseye.sources
BULLSEYE_PIN=/etc/apt/preferences.d/mtp-edge-bullseye
APT=(apt-get -y -q --no-install-recommends -o APT::Keep-Downloaded-Packages=true)

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

current=()
for package in aapt zipalign apksigner libandroid-json-java; do
  installed "$package" || current+=("$package")
done
command -v javac >/dev/null && command -v keytool >/dev/null || current+=(default-jdk-headless)
command -v npm >/dev/null || current+=(npm)
old=()
for package in android-sdk-platform-23 dalvik-exchange; do
  installed "$package" || old+=("$package")
done
kotlinc_home() { [ -x "$(npm root -g 2>/dev/null)/kotlin-compiler/bin/kotlinc" ]; }

if [ ${#current[@]} -gt 0 ]; then
  "${APT[@]}" install "${current[@]}" || { apt-get update -q && "${APT[@]}" install "${current[@]}"; }
fi

. /etc/os-release
if [ ${#old[@]} -gt 0 ] && [ "${VERSION_CODENAME:-}" = bullseye ]; then
  "${APT[@]}" install "${old[@]}" || { apt-get update -q && "${APT[@]}" install "${old[@]}"; }
elif [ ${#old[@]} -gt 0 ]; then
  if [ ! -f "$BULLSEYE_SOURCE" ]; then
    # The mirror of this release's main suite, from either source format.
    mirror=$(
      { grep -hs -E '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}'
        grep -hs -E '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list |
          sed -E 's/\[[^]]*\]//' | awk '{print $2}'
      } | grep -v -- '-security' | head -n 1
    ) || true  # grep finds no file of one format or the other
    mirror=${mirror:-http://deb.debian.org/debian}
    cat >"$BULLSEYE_SOURCE" <<EOF
# Debian 11 for android-sdk-platform-23 and dalvik-exchange only (android_demo/install-build-tools.sh)
Types: deb
URIs: $mirror
Suites: bullseye
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    cat >"$BULLSEYE_PIN" <<EOF
# Debian 11: only packages asked for by name that no newer suite has (android_demo/install-build-tools.sh)
Package: *
Pin: release n=bullseye
Pin-Priority: 1
EOF
  fi
  if [ -z "$(apt-cache madison android-sdk-platform-23 dalvik-exchange 2>/dev/null)" ]; then
    # Only the bullseye lists: the others stay as they are.
    apt-get update -q -o Dir::Etc::sourcelist="$BULLSEYE_SOURCE" -o Dir::Etc::sourceparts=- \
      -o APT::Get::List-Cleanup=0
  fi
  "${APT[@]}" install "${old[@]}"
fi

if ! kotlinc_home; then
  npm install -g --prefer-offline --no-audit --no-fund "$KOTLIN_COMPILER"
fi
