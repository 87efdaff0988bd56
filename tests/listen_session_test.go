package tests

import (
	"context"
	"net/url"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
)

// A LISTEN connection whose path breaks while its session takes the
// liveness lock (a statement that never answers) is given up within
// seconds, and the next session holds the lock: the set-up of a session is
// bounded in time like its checks.
func TestListenSessionThatHangsInItsSetUpIsReplaced(t *testing.T) {
	t.Parallel()
	b := setup(t)
	px := startTrapProxy(t, b.DSN, "pg_try_advisory_lock")
	app := "trap-" + watermill.NewShortUUID()
	sub := b.subscriberOn(t, b.namedPool(t, app+"-pool"), func(c *pgoutbox.SubscriberConfig) {
		c.ListenDSN = viaProxy(t, b.DSN, px.addr, app)
	})
	_, err := sub.Subscribe(t.Context(), "t")
	require.NoError(t, err)
	held := func() int {
		return b.count(t, `SELECT count(*) FROM pg_catalog.pg_locks l JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
 WHERE l.locktype = 'advisory' AND l.classid = $1 AND l.objsubid = 2 AND l.granted AND a.application_name = $2`, query.LivenessClass, app)
	}
	pollUntil(t, "the lock taken", 20*time.Second, nil, func() bool { return held() == 1 })

	px.armed.Store(true) // the next session's lock statement goes unanswered
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1) x`, app))
	pollUntil(t, "the next session trapped taking the lock", 10*time.Second, nil, func() bool { return px.trapped.Load() == 1 })
	trapped := time.Now()
	pollUntil(t, "a session after the trapped one holds the lock", 30*time.Second, nil, func() bool { return held() == 1 })
	t.Logf("the lock back %s after the trap", time.Since(trapped).Round(time.Millisecond))
}

// A ListenDSN that reaches another database than the pool (a DSN without
// a database name reaches the one named like the user) took its liveness
// lock there, where the other subscribers do not look: they took its
// messages in flight for a crashed process's and delivered them again,
// and it got no wake-ups. Subscribe refuses it, saying what to do; the
// pool's database reached through another address is accepted.
func TestListenDSNOfAnotherDatabaseIsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	other := mustParse(t, b.DSN)
	other.Path = "/postgres"
	if mustParse(t, b.DSN).Path == "/postgres" {
		other.Path = "/template1"
	}
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { c.ListenDSN = other.String() })
	_, err := sub.Subscribe(ctx, "listen-elsewhere")
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
	require.ErrorContains(t, err, "point ListenDSN at the pool's database")

	px := startTCPProxy(t, b.DSN)
	same := mustParse(t, b.DSN)
	same.Host = px.addr
	ok := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { c.ListenDSN = same.String() })
	msgs, err := ok.Subscribe(ctx, "listen-here")
	require.NoError(t, err)
	require.NoError(t, b.poolPublisher(t).Publish("listen-here", newMsgs(1)...))
	select {
	case m := <-msgs:
		m.Ack()
	case <-ctx.Done():
		t.Fatal("no message through a subscriber whose ListenDSN reaches the pool's database")
	}
}

func mustParse(t *testing.T, dsn string) *url.URL {
	t.Helper()
	u, err := url.Parse(dsn)
	require.NoError(t, err)
	return u
}
