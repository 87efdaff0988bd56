// Package pgoutboxui is a web page for the operators of a pgoutbox outbox:
// every topic and consumer group with its counts, charts over time, the
// pending messages of a group, blocked ordering keys, dead letters to read,
// requeue and delete, and pausing and resuming a consumer group.
//
// Mount it under your own router and authentication:
//
//	ui := pgoutboxui.Handler(tx.FromPgxPool(pool), tables, pgoutboxui.Options{BasePath: "/outbox/"})
//	defer ui.Close()
//	mux.Handle("/outbox/", requireOperator(ui))
//
// or run it from the CLI: pgoutbox ui --listen 127.0.0.1:8080.
//
// It is read-only unless Options.Writes is set. Every write is a POST
// carrying a CSRF token (double submit: a random cookie and the same value,
// signed with a per-handler random secret, in the form) and goes through a
// confirmation page that says how many rows it will touch. Pages are
// rendered on the server from html/template (every value escaped for its
// context), work without JavaScript, load nothing from elsewhere, and are
// served with a Content-Security-Policy that allows no inline script.
//
// Lifecycle: Handler returns a *UI. Its sampler goroutine starts with the
// first request (or Start) and takes one Stats sample of the whole outbox
// every Options.SampleInterval into a bounded ring per topic and group,
// however many browsers are open; Close stops it. Pages never count the
// outbox themselves beyond one topic and group: the overview is served from
// the latest sample, the group page reads that group through its indexes.
package pgoutboxui
