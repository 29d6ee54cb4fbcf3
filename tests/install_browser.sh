#!/bin/sh
# The headless browser that tests/notebooks/test_browser.py drives (Debian's chromium-headless-shell, ~96 MB).
# Installed with apt-get where that is possible (root on Debian: CI); elsewhere this prints how to
# install it and the browser test is skipped. LABKIT_REQUIRE_BROWSER=1 (CI) makes a missing browser
# an error here and in the test.
set -e
if [ -n "$LABKIT_CHROMIUM" ] || command -v chromium-headless-shell >/dev/null 2>&1 ||
        [ -x /usr/bin/chromium-headless-shell ]; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "+ apt-get update; apt-get install --no-install-recommends chromium-headless-shell  (tests/notebooks/test_browser.py)"
    apt-get update -qq
    if apt-cache show chromium-headless-shell >/dev/null 2>&1; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            chromium-headless-shell
        exit 0
    fi
fi
echo "note: chromium-headless-shell is not installed, so tests/notebooks/test_browser.py will be skipped." >&2
echo "      Debian: sudo apt-get install --no-install-recommends chromium-headless-shell;" >&2
echo "      or point LABKIT_CHROMIUM at a Chromium/Chrome binary." >&2
[ "$LABKIT_REQUIRE_BROWSER" != 1 ]
