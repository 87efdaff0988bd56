package tests

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// startPgBouncer runs pgbouncer in transaction pooling mode in front of the
// server of dsn, on a free port, until the test ends, and returns dsn
// pointed at it. It skips the test when pgbouncer is not installed, unless
// PGOUTBOX_REQUIRE_PGBOUNCER is set.
func startPgBouncer(t *testing.T, dsn string) string {
	t.Helper()
	bin, err := exec.LookPath("pgbouncer")
	if err != nil {
		if os.Getenv("PGOUTBOX_REQUIRE_PGBOUNCER") != "" {
			t.Fatalf("pgbouncer is not installed and PGOUTBOX_REQUIRE_PGBOUNCER is set: %v", err)
		}
		t.Skip("pgbouncer is not installed (apt-get install pgbouncer); set PGOUTBOX_REQUIRE_PGBOUNCER to fail instead")
	}
	u, err := url.Parse(dsn)
	require.NoError(t, err)
	host, port, err := net.SplitHostPort(u.Host)
	if err != nil {
		host, port = u.Hostname(), "5432"
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	bouncerPort := l.Addr().(*net.TCPAddr).Port
	require.NoError(t, l.Close())

	dir := t.TempDir()
	require.NoError(t, os.Chmod(dir, 0o755)) // readable by the user pgbouncer switches to
	userName := u.User.Username()
	ini := fmt.Sprintf(`[databases]
* = host=%s port=%s

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = trust
auth_file = %s
pool_mode = transaction
max_client_conn = 200
default_pool_size = 20
ignore_startup_parameters = extra_float_digits
`, host, port, bouncerPort, filepath.Join(dir, "userlist.txt"))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "pgbouncer.ini"), []byte(ini), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "userlist.txt"), []byte(strconv.Quote(userName)+` ""`+"\n"), 0o644))

	args := []string{filepath.Join(dir, "pgbouncer.ini")}
	if me, err := user.Current(); err == nil && me.Uid == "0" {
		args = append([]string{"-u", "postgres"}, args...) // pgbouncer refuses to run as root
	}
	cmd := exec.Command(bin, args...)
	out := &lockedBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("pgbouncer output:\n%s", out.String())
		}
	})
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(bouncerPort))
	require.Eventually(t, func() bool {
		c, err := net.DialTimeout("tcp", addr, 100*time.Millisecond)
		if err == nil {
			_ = c.Close()
		}
		return err == nil
	}, 10*time.Second, 20*time.Millisecond, "pgbouncer did not listen on %s: %s", addr, out)
	u.Host = addr
	return u.String()
}

// TestPgBouncerTransactionPooling publishes and consumes through PgBouncer
// in transaction pooling mode with pgx's simple protocol (no prepared
// statements kept across transactions). The subscriber's LISTEN connection
// goes through PgBouncer too, where notifications do not arrive: polling
// (MaxPollInterval) delivers everything, a timer included.
func TestPgBouncerTransactionPooling(t *testing.T) {
	env := pgoutboxtest.PubSub(t)
	bouncerDSN := startPgBouncer(t, env.DSN)

	cfg, err := pgxpool.ParseConfig(bouncerDSN)
	require.NoError(t, err)
	cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	cfg.MaxConns = 8
	ctx := context.Background()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)

	logger := watermill.NewStdLogger(os.Getenv("PGOUTBOX_TEST_DEBUG") != "", false)
	pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(pool), pgoutbox.PublisherConfig{Tables: env.Tables}, logger)
	require.NoError(t, err)
	sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{
		Tables:          env.Tables,
		MaxInFlight:     4,
		Lease:           5 * time.Second,
		MinPollInterval: 20 * time.Millisecond,
		MaxPollInterval: 200 * time.Millisecond,
		DrainTimeout:    2 * time.Second,
	}, logger)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })

	subCtx, cancel := context.WithCancel(ctx)
	t.Cleanup(cancel)
	orders, err := sub.Subscribe(subCtx, "orders")
	require.NoError(t, err)
	timers, err := sub.Subscribe(subCtx, "timers")
	require.NoError(t, err)

	// Published in transactions of our own through PgBouncer, too.
	const n = 200
	want := map[string]bool{}
	for i := range n {
		msg := message.NewMessage(watermill.NewUUID(), []byte(strconv.Itoa(i)))
		want[msg.UUID] = true
		if i%2 == 0 {
			require.NoError(t, pub.Publish("orders", msg))
			continue
		}
		pgxTx, err := pool.Begin(ctx)
		require.NoError(t, err)
		txPub, err := pgoutbox.NewPublisher(tx.FromPgxTx(pgxTx), pgoutbox.PublisherConfig{Tables: env.Tables}, logger)
		require.NoError(t, err)
		require.NoError(t, txPub.Publish("orders", msg))
		require.NoError(t, pgxTx.Commit(ctx))
	}
	timer := message.NewMessage(watermill.NewUUID(), []byte("later"))
	pgoutbox.DeliverAfter(timer, 300*time.Millisecond)
	published := time.Now()
	require.NoError(t, pub.Publish("timers", timer))

	for _, m := range pgoutboxtest.Collect(t, orders, n, 30*time.Second) {
		require.True(t, want[m.UUID], "unexpected or duplicate message %s", m.UUID)
		delete(want, m.UUID)
	}
	require.Empty(t, want)
	got := pgoutboxtest.Collect(t, timers, 1, 10*time.Second)
	require.Equal(t, timer.UUID, got[0].UUID)
	require.GreaterOrEqual(t, time.Since(published), 300*time.Millisecond, "the timer came early")

	// The acks were written: nothing is left (read directly, not through PgBouncer).
	cancel()
	require.NoError(t, sub.Close())
	stats, err := pgoutbox.Stats(ctx, tx.FromPgxPool(env.Pool), env.Tables)
	require.NoError(t, err)
	for _, s := range stats {
		require.Zero(t, s.Ready+s.Scheduled+s.Leased+s.ExpiredLeases+s.Parked, "%+v", s)
	}
}

// lockedBuffer collects a subprocess's output, read while it writes.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// With ListenDSN, a direct connection for LISTEN, a subscriber whose pool
// goes through PgBouncer is woken by notifications again: with polling set
// to 30 s, a message published through PgBouncer arrives long before the
// next poll could have found it.
func TestPgBouncerListenDSNBringsWakeUpsBack(t *testing.T) {
	env := pgoutboxtest.PubSub(t)
	bouncerDSN := startPgBouncer(t, env.DSN)
	cfg, err := pgxpool.ParseConfig(bouncerDSN)
	require.NoError(t, err)
	cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	ctx := context.Background()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)

	// The direct connection carries a name of its own, to find it.
	listenName := "pgoutbox-listen-" + env.Schema
	u, err := url.Parse(env.DSN)
	require.NoError(t, err)
	q := u.Query()
	q.Set("application_name", listenName)
	u.RawQuery = q.Encode()
	ev := newEvents()
	sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{
		Tables:          env.Tables,
		ListenDSN:       u.String(),
		Observer:        ev,
		Lease:           time.Minute,
		MinPollInterval: 30 * time.Second,
		MaxPollInterval: 30 * time.Second,
	}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	msgs, err := sub.Subscribe(ctx, "orders")
	require.NoError(t, err)
	// The first claim (at start) finds nothing, and so does the one after
	// the LISTEN connection is up (a connect wakes every loop); then the
	// loop sleeps for the poll interval unless a notification wakes it.
	pollUntil(t, "the subscription is listening and idle", 10*time.Second, nil, func() bool {
		return ev.countKind(pgoutbox.EventClaimed) >= 2
	})
	pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(pool), pgoutbox.PublisherConfig{Tables: env.Tables}, nil)
	require.NoError(t, err)
	msg := message.NewMessage(watermill.NewUUID(), []byte("wake up"))
	require.NoError(t, pub.Publish("orders", msg))
	got := pgoutboxtest.Collect(t, msgs, 1, 15*time.Second) // a poll would take 30 s
	require.Equal(t, msg.UUID, got[0].UUID)
	// The LISTEN connection, holder of the liveness lock, is the direct one.
	var direct int
	require.NoError(t, env.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
		WHERE a.application_name = $1 AND l.locktype = 'advisory' AND l.classid = $2`, listenName, query.LivenessClass).Scan(&direct))
	require.Equal(t, 1, direct, "the liveness lock is held on the ListenDSN connection")

	_, err = pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{Tables: env.Tables, ListenDSN: "postgres://%%bad"}, nil)
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
	require.Contains(t, err.Error(), "ListenDSN")
}

// TestPgBouncerLeavesNoLivenessLockBehind: a subscriber whose LISTEN
// connection goes through PgBouncer (no ListenDSN) takes no liveness lock.
// In transaction mode the lock would sit on whichever server connection
// took it, stay there after the process exits (PgBouncer keeps the
// connection), and be taken again, on another one, each time the
// statements moved. It says so once, and its leases carry no key.
func TestPgBouncerLeavesNoLivenessLockBehind(t *testing.T) {
	env := pgoutboxtest.PubSub(t)
	bouncerDSN := startPgBouncer(t, env.DSN)
	name := "pgoutbox-pooled-" + env.Schema // PgBouncer sets it on the server connections it lends
	u, err := url.Parse(bouncerDSN)
	require.NoError(t, err)
	q := u.Query()
	q.Set("application_name", name)
	u.RawQuery = q.Encode()
	cfg, err := pgxpool.ParseConfig(u.String())
	require.NoError(t, err)
	cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	ctx := context.Background()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)

	locks := func() int {
		var n int
		require.NoError(t, env.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
			WHERE a.application_name = $1 AND l.locktype = 'advisory' AND l.classid = $2`, name, query.LivenessClass).Scan(&n))
		return n
	}
	logs := &logCapture{}
	ev := newEvents()
	sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{
		Tables:          env.Tables,
		ClaimMode:       pgoutbox.ClaimLease,
		MaxInFlight:     20,
		Observer:        ev,
		Lease:           time.Minute,
		MinPollInterval: 20 * time.Millisecond,
		MaxPollInterval: 200 * time.Millisecond,
	}, logs)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	msgs, err := sub.Subscribe(ctx, "orders")
	require.NoError(t, err)
	pollUntil(t, "the pooler is noticed", 10*time.Second, nil, func() bool {
		return len(logs.find("info", func(e logEntry) bool { return strings.Contains(e.msg, "connection pooler") })) > 0
	})

	pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(env.Pool), pgoutbox.PublisherConfig{Tables: env.Tables}, nil)
	require.NoError(t, err)
	require.NoError(t, pub.Publish("orders", newMsgs(20)...))
	var got []*message.Message
	for range 20 {
		got = append(got, receive(t, msgs, 15*time.Second))
	}
	// Leased, not acked yet: stamped with no key.
	b := &bundle{Env: env, tables: env.Tables}
	require.Zero(t, b.count(t, `SELECT count(*) FROM `+env.Schema+`.outbox WHERE lease_holder IS NOT NULL`), "a lease carries a liveness key")
	require.Equal(t, 20, b.count(t, `SELECT count(*) FROM `+env.Schema+`.outbox WHERE lease_token IS NOT NULL`))
	require.Zero(t, locks(), "a liveness lock on a server connection PgBouncer lends")
	require.Empty(t, listeningThrough(t, bouncerDSN), "a LISTEN on a server connection PgBouncer lends: other clients get the outbox's notifications")
	for _, m := range got {
		m.Ack()
	}
	require.NoError(t, sub.Close())
	require.Zero(t, locks(), "a liveness lock left behind")
	require.Empty(t, listeningThrough(t, bouncerDSN), "a LISTEN left behind")
}

// listeningThrough returns the channels any of PgBouncer's server
// connections listens on: as many transactions through it at once as its
// pool has connections (startPgBouncer's default_pool_size), so each runs
// on a server connection of its own, and together on all of them.
func listeningThrough(t *testing.T, bouncerDSN string) []string {
	t.Helper()
	const poolSize = 20
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cfg, err := pgx.ParseConfig(bouncerDSN)
	require.NoError(t, err)
	cfg.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	var (
		mu       sync.Mutex
		channels []string
		asked    sync.WaitGroup
		done     = make(chan struct{})
		errs     = make(chan error, poolSize)
	)
	asked.Add(poolSize)
	for range poolSize {
		go func() {
			errs <- func() error {
				answered := false
				defer func() {
					if !answered {
						asked.Done()
					}
				}()
				conn, err := pgx.ConnectConfig(ctx, cfg)
				if err != nil {
					return err
				}
				defer conn.Close(context.Background())
				ptx, err := conn.Begin(ctx)
				if err != nil {
					return err
				}
				defer func() { _ = ptx.Rollback(context.Background()) }()
				rows, err := ptx.Query(ctx, `SELECT pg_listening_channels()`)
				if err != nil {
					return err
				}
				chs, err := pgx.CollectRows(rows, pgx.RowTo[string])
				if err != nil {
					return err
				}
				mu.Lock()
				channels = append(channels, chs...)
				mu.Unlock()
				answered = true
				asked.Done()
				<-done // keep the server connection until every other one is asked
				return nil
			}()
		}()
	}
	asked.Wait()
	close(done)
	for range poolSize {
		require.NoError(t, <-errs)
	}
	return channels
}

// A ListenDSN that reaches PgBouncer too is named as the cause, not
// advised as if it were unset.
func TestPgBouncerListenDSNThroughThePoolerIsNamed(t *testing.T) {
	env := pgoutboxtest.PubSub(t)
	bouncerDSN := startPgBouncer(t, env.DSN)
	u, err := url.Parse(bouncerDSN)
	require.NoError(t, err)
	q := u.Query()
	q.Set("default_query_exec_mode", "simple_protocol")
	u.RawQuery = q.Encode()
	logs := &logCapture{}
	sub, err := pgoutbox.NewSubscriber(env.Pool, pgoutbox.SubscriberConfig{
		Tables:    env.Tables,
		ListenDSN: u.String(),
	}, logs)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	_, err = sub.Subscribe(context.Background(), "orders")
	require.NoError(t, err)
	var said []logEntry
	pollUntil(t, "the pooler is noticed", 10*time.Second, nil, func() bool {
		said = logs.find("info", func(e logEntry) bool { return strings.Contains(e.msg, "connection pooler") })
		return len(said) > 0
	})
	require.Contains(t, said[0].msg, "ListenDSN reaches the pooler")
	require.NotContains(t, said[0].msg, "set SubscriberConfig.ListenDSN")
}

// Through PgBouncer in transaction pooling mode without pgx's simple
// protocol, statements one client prepared stay on the server connection
// the next client gets: the first run works, the next fails with the
// server's bare "prepared statement ... already exists". Subscribe's error
// names the cause and the setting, as the CLI's does (TestHintNamesPgBouncer
// in cmd/pgoutbox).
func TestPgBouncerWithoutTheSimpleProtocolSaysSo(t *testing.T) {
	env := pgoutboxtest.PubSub(t)
	bouncerDSN := startPgBouncer(t, env.DSN)
	ctx := context.Background()
	subscribe := func() error {
		cfg, err := pgxpool.ParseConfig(bouncerDSN)
		require.NoError(t, err)
		cfg.MaxConns = 1 // one server connection, handed from client to client
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		require.NoError(t, err)
		defer pool.Close()
		sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{Tables: env.Tables}, nil)
		require.NoError(t, err)
		defer sub.Close()
		_, err = sub.Subscribe(ctx, "t")
		return err
	}
	var err error
	for range 5 {
		if err = subscribe(); err != nil {
			break
		}
	}
	require.Error(t, err, "a second client on the first one's server connection meets its prepared statements")
	require.Contains(t, err.Error(), "default_query_exec_mode=simple_protocol")
}

// A subscriber whose pool keeps prepared statements (pgx's default) behind
// PgBouncer passed Subscribe on a pooler whose server connections were
// fresh, and its claims and acks failed later, messages handled twice at
// a failed held batch's end: Subscribe warns of it at once, before any
// statement such a pooler may fail (one may fail Subscribe itself, when
// the pooler has several server connections). With the simple protocol
// it does not warn.
func TestPgBouncerWithPreparedStatementsWarnsAtSubscribe(t *testing.T) {
	env := pgoutboxtest.PubSub(t)
	bouncerDSN := startPgBouncer(t, env.DSN)
	ctx := context.Background()
	warned := func(mode pgx.QueryExecMode) bool {
		cfg, err := pgxpool.ParseConfig(bouncerDSN)
		require.NoError(t, err)
		cfg.MaxConns = 1
		cfg.ConnConfig.DefaultQueryExecMode = mode
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		require.NoError(t, err)
		defer pool.Close()
		logs := &logCapture{}
		sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{Tables: env.Tables}, logs)
		require.NoError(t, err)
		defer sub.Close()
		_, err = sub.Subscribe(ctx, "t")
		if mode == pgx.QueryExecModeCacheStatement && err != nil {
			// What the warning is about may come at once (a statement
			// prepared on one server connection ran on another): the
			// warning came first, and the error says what to set.
			require.ErrorContains(t, err, "set default_query_exec_mode=simple_protocol in the DSN")
		} else {
			require.NoError(t, err)
		}
		return len(logs.find("info", func(e logEntry) bool { return strings.Contains(e.msg, "keeps prepared statements") })) > 0
	}
	require.False(t, warned(pgx.QueryExecModeSimpleProtocol), "the documented setting")
	require.True(t, warned(pgx.QueryExecModeCacheStatement), "pgx's default")
}
