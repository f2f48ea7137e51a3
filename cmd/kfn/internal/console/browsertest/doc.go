// Package browsertest drives kfn console in a real headless Chromium
// (chromedp over the DevTools protocol) against real Postgres, NATS and
// Kafka with a running function. It is a module of its own, so chromedp
// never enters the go.mod that kfn's users inherit.
//
// Set KFN_CONSOLE_SCREENSHOTS to a directory (docs/console for the docs) to
// write a screenshot of each page there; KFN_CHROMIUM names the browser
// (default /usr/bin/chromium, Debian's chromium package).
package browsertest
