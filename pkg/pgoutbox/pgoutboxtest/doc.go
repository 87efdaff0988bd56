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
// started for the run, else StartServer, a hook for Docker. pgoutbox does
// not depend on a container library; with github.com/ory/dockertest/v3 in
// your own module:
//
//	func TestMain(m *testing.M) {
//		var resource *dockertest.Resource
//		pgoutboxtest.StartServer = func(ctx context.Context) (string, error) {
//			pool, err := dockertest.NewPool("")
//			if err != nil {
//				return "", err
//			}
//			resource, err = pool.Run("postgres", "17", []string{"POSTGRES_HOST_AUTH_METHOD=trust"})
//			if err != nil {
//				return "", err
//			}
//			dsn := "postgres://postgres@" + resource.GetHostPort("5432/tcp") + "/postgres?sslmode=disable"
//			return dsn, pool.Retry(func() error { c, err := pgx.Connect(ctx, dsn); if err == nil { c.Close(ctx) }; return err })
//		}
//		code := pgoutboxtest.Run(m)
//		if resource != nil {
//			_ = resource.Close()
//		}
//		os.Exit(code)
//	}
//
// When no way works, a test fails with a message listing them, or skips
// with Options.SkipIfNoDatabase.
package pgoutboxtest
