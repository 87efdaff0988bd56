// Package browser drives the operator page (pkg/pgoutbox/pgoutboxui) in a
// real headless Chromium: a module of its own, so the library does not
// depend on chromedp. The tests skip where no Chromium is installed,
// unless PGOUTBOX_REQUIRE_BROWSER is set; PGOUTBOX_SCREENSHOTS=dir makes
// TestScreenshots write the documentation's screenshots there.
package browser
