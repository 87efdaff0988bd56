// Package pgoutboxtest gives tests a real PostgreSQL Pub/Sub in one line,
// and assertions on what code under test published.
//
//	func TestShipping(t *testing.T) {
//		t.Parallel()
//		env := pgoutboxtest.PubSub(t) // publisher, subscriber, pool; isolated, cleaned up
//		require.NoError(t, env.Publisher.Publish("orders.placed", message.NewMessage(watermill.NewUUID(), []byte(`{"id":42}`))))
//		msgs := env.Drain(t, "orders.placed", 1, 10*time.Second)
//		...
//	}
//
// Each test gets an outbox in a PostgreSQL schema no other running test
// uses. Schemas are created once per process and reused after TRUNCATE, so
// a suite of hundreds of tests does not pay for creating tables each time.
// Use Main as the TestMain of packages that use it, to drop the schemas
// when the tests end (without it the next run drops them).
//
// # Assertions
//
// RequirePublished, RequireNotPublished and RequireScheduled read the
// outbox through a tx.Executor: inside the caller's transaction they see
// what it published before it commits. A failure lists what the topic
// does hold. Drain and Collect receive, ack and count messages.
//
// # Finding PostgreSQL
//
// ServerDSN finds a server the way the project's `make test` does:
// POSTGRES_DSN, else 127.0.0.1:5432, else a locally installed PostgreSQL
// started for the run, else StartServer, a hook for Docker. The schemas go
// into the database POSTGRES_DSN names (postgres://localhost/myapp_test:
// myapp_test, which must exist); when it names none, or the server's own
// postgres database, they go into Database, "pgoutbox_test", created on
// first use, so tests never fill a database they were not given.
//
// The module github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest/dockerpg
// sets StartServer to start PostgreSQL in Docker (with dockertest); it is a
// module of its own so that the Docker client stays out of your module
// graph unless you ask for it:
//
//	func TestMain(m *testing.M) { dockerpg.Main(m) }
//
// Any other way of starting a server fits the same hook: a function that
// starts it and returns its DSN.
//
// When no way works, a test fails with a message listing them, or skips
// with Options.SkipIfNoDatabase.
package pgoutboxtest
