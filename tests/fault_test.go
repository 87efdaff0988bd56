package tests

// Fault tests: delivery survives killed server connections and a killed
// consumer process: nothing is deleted without an ack, nothing is lost
// (invariants 3 and 6 in docs/delivery.md).

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// TestFaultTerminatedConnections terminates every server connection of a
// subscriber (its pool connections and its LISTEN connection) every 100-300
// ms while 5,000 messages flow through a router. Every message is handled,
// and once the killing stops nothing stays stuck in the outbox.
func TestFaultTerminatedConnections(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	const (
		messages     = 5000
		batchSize    = 25
		publishEvery = 20 * time.Millisecond // 1,250 messages/s: about 4s of flow
		minRounds    = 10
		topic        = "t"
	)

	// The subscriber's own pool, named so its backends can be found. The
	// notifier opens the LISTEN connection with the pool's ConnConfig, so it
	// carries the same application_name.
	appName := "pgoutbox-fault-" + b.Schema
	poolCfg, err := pgxpool.ParseConfig(b.DSN)
	require.NoError(t, err)
	poolCfg.MaxConns = 10
	poolCfg.ConnConfig.RuntimeParams["application_name"] = appName
	subPool, err := pgxpool.NewWithConfig(ctx, poolCfg)
	require.NoError(t, err)
	t.Cleanup(subPool.Close)

	var leaseLost atomic.Int64
	logs := &logCapture{}
	sub, err := pgoutbox.NewSubscriber(subPool, pgoutbox.SubscriberConfig{
		Tables:          b.tables,
		MaxInFlight:     8,
		Lease:           2 * time.Second,
		MinPollInterval: 20 * time.Millisecond,
		MaxPollInterval: time.Second,
		Observer: pgoutbox.ObserverFunc(func(e pgoutbox.Event) {
			if e.Kind == pgoutbox.EventLeaseLost {
				leaseLost.Add(1)
			}
		}),
	}, logs)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })

	var (
		mu      sync.Mutex
		handled = map[string]int{}
	)
	runRouter(t, sub, topic, func(m *message.Message) error {
		mu.Lock()
		handled[m.UUID]++
		mu.Unlock()
		return nil
	})

	// The killer uses the test's pool (another application_name), so it
	// never terminates itself.
	k := startKiller(b.Pool, appName)
	t.Cleanup(k.stop)

	// Publish at a steady pace, slower than the subscriber consumes, so
	// rows are claimed, handled and acked during the whole run, and wait for
	// a new round of terminations every 1/minRounds of the messages, so at
	// least minRounds-1 rounds strike while messages flow.
	k.waitRound(t)
	pub := b.poolPublisher(t)
	published := make([]string, 0, messages)
	pace := time.NewTicker(publishEvery)
	defer pace.Stop()
	roundsBefore := k.count.Load()
	for i := range messages / batchSize {
		<-pace.C
		msgs := make([]*message.Message, batchSize)
		for j := range msgs {
			msgs[j] = newMsg(fmt.Sprintf("%d-%d", i, j))
			published = append(published, msgs[j].UUID)
		}
		require.NoError(t, pub.Publish(topic, msgs...))
		if (i+1)%(messages/batchSize/minRounds) == 0 {
			k.waitRound(t)
		}
	}
	pace.Stop()
	roundsWhilePublishing := k.count.Load() - roundsBefore

	distinct := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(handled)
	}
	pollUntil(t, "every message is handled while connections are being terminated", 45*time.Second, nil,
		func() bool { return distinct() == messages })
	for k.count.Load() < minRounds {
		k.waitRound(t)
	}
	k.stop()
	require.NoError(t, k.err, "terminating the subscriber's backends")

	// Verdicts whose writes failed are retried, and rows claimed by a
	// statement whose result was lost come back when their lease expires:
	// nothing stays.
	pollUntil(t, "the outbox is empty once the connections are left alone", 60*time.Second, nil,
		func() bool { return b.outboxRows(t, topic) == 0 })

	mu.Lock()
	defer mu.Unlock()
	total := 0
	for _, id := range published {
		require.GreaterOrEqual(t, handled[id], 1, "message %s was never handled", id)
	}
	for _, n := range handled {
		total += n
	}
	terminated, listen := 0, 0
	for i, r := range k.rounds {
		require.GreaterOrEqual(t, r.terminated, 1, "round %d terminated no backend", i)
		terminated += r.terminated
		listen += r.listen
	}
	t.Logf("messages=%d distinct_handled=%d total_handled=%d duplicates=%d rounds=%d (while publishing %d) backends_terminated=%d listen_terminated=%d lease_lost=%d errors_logged=%d",
		messages, len(handled), total, total-messages, len(k.rounds), roundsWhilePublishing, terminated, listen, leaseLost.Load(),
		len(logs.find("error", func(logEntry) bool { return true })))
	require.Len(t, handled, messages, "only published messages are handled")
	require.GreaterOrEqual(t, len(k.rounds), minRounds, "too few rounds of terminations")
	require.GreaterOrEqual(t, roundsWhilePublishing, int64(minRounds-1), "too few rounds while messages flowed")
	require.GreaterOrEqual(t, listen, 1, "the LISTEN connection must have been terminated too")
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_dlq`))
}

// killer terminates, every 100-300 ms, every backend whose application_name
// is appName. Each round waits (up to roundTimeout) until there is at least
// one backend to terminate, so a round never counts without a hit and a
// subscriber that does not reconnect fails the test.
type killer struct {
	cancel context.CancelFunc
	done   chan struct{}
	round  chan struct{} // a value after every round, dropped if nobody waits

	count atomic.Int64 // rounds so far

	// Written by the killer goroutine; read after done is closed.
	rounds []killRound
	err    error
}

type killRound struct {
	terminated int // backends terminated
	listen     int // of them, LISTEN connections
}

const roundTimeout = 5 * time.Second

// isListenConn is true for a pg_stat_activity row of a notifier's LISTEN
// connection: its last statement was LISTEN, the check for a pooler that
// follows it at a session's start, or one of the liveness queries
// (query.TryLiveness, query.LiveHoldersMine).
const isListenConn = `(query LIKE 'LISTEN %' OR query = 'SELECT pg_backend_pid()' OR query LIKE 'SELECT pg_try_advisory_lock(%' OR query LIKE 'SELECT objid::bigint, pid = pg_backend_pid()%')`

// terminateBackends terminates the backends named appName and waits for
// each to exit (so the next round cannot count a dying backend again). It
// returns one row per backend found; the LISTEN connection is the one whose
// last statement was one of its own (isListenConn).
const terminateBackends = `SELECT pg_terminate_backend(pid, 2000), ` + isListenConn + `
  FROM pg_stat_activity
 WHERE application_name = $1 AND pid <> pg_backend_pid()`

func startKiller(pool *pgxpool.Pool, appName string) *killer {
	ctx, cancel := context.WithCancel(context.Background())
	k := &killer{cancel: cancel, done: make(chan struct{}), round: make(chan struct{}, 1)}
	go func() {
		defer close(k.done)
		for {
			pause := time.NewTimer(100*time.Millisecond + rand.N(200*time.Millisecond))
			select {
			case <-ctx.Done():
				pause.Stop()
				return
			case <-pause.C:
			}
			r, err := k.terminate(ctx, pool, appName)
			if ctx.Err() != nil {
				return
			}
			if err != nil {
				k.err = err
				return
			}
			k.rounds = append(k.rounds, r)
			k.count.Add(1)
			select {
			case k.round <- struct{}{}:
			default:
			}
		}
	}()
	return k
}

func (k *killer) terminate(ctx context.Context, pool *pgxpool.Pool, appName string) (killRound, error) {
	deadline := time.Now().Add(roundTimeout)
	poll := time.NewTicker(10 * time.Millisecond)
	defer poll.Stop()
	for {
		var r killRound
		rows, err := pool.Query(ctx, terminateBackends, appName)
		if err != nil {
			return r, err
		}
		for rows.Next() {
			var ok, listen bool
			if err := rows.Scan(&ok, &listen); err != nil {
				rows.Close()
				return r, err
			}
			if ok {
				r.terminated++
				if listen {
					r.listen++
				}
			}
		}
		if err := rows.Err(); err != nil {
			return r, err
		}
		if r.terminated > 0 {
			return r, nil
		}
		if time.Now().After(deadline) {
			return r, fmt.Errorf("round %d: no backend named %q to terminate within %s; the subscriber did not reconnect", len(k.rounds), appName, roundTimeout)
		}
		select {
		case <-ctx.Done():
			return r, ctx.Err()
		case <-poll.C:
		}
	}
}

// waitRound waits for the next round of terminations.
func (k *killer) waitRound(t *testing.T) {
	t.Helper()
	select {
	case <-k.round:
	case <-k.done:
		t.Fatalf("the killer stopped: %v", k.err)
	case <-time.After(2 * roundTimeout):
		t.Fatal("no round of terminations within 10s")
	}
}

// stop ends the killing and waits for the goroutine; idempotent.
func (k *killer) stop() {
	k.cancel()
	<-k.done
}

// maxKillDuplicates bounds the messages a SIGKILLed consumer handled without
// its acks reaching the database, which are then handled again by the next
// consumer: up to MaxInFlight (8) messages in its handlers, plus up to
// maxPendingCompletions (256, pkg/pgoutbox/completer.go) verdicts a
// subscription holds recorded but not yet written (pending or in the write
// under way), plus the acks recorded in its open held batches, whose
// transactions roll back (maxHeldBatches, 3, of at most maxClaim, 256,
// rows: pkg/pgoutbox/held.go). Rows it had only prefetched were never
// handled: they come back without being duplicates.
const maxKillDuplicates = 8 + 256 + 3*256

// TestFaultKilledConsumerProcess SIGKILLs a consumer process in the middle
// of a 2,000-message drain; a second process finishes it. Every message is
// handled, duplicates stay within what the first process held unacked, and
// nothing is left behind.
func TestFaultKilledConsumerProcess(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	const (
		messages  = 2000
		batches   = 4
		killAfter = 600
		topic     = "t"
		lease     = 2 * time.Second // the consumer's Lease
	)
	b.handledTable(t)

	published := make([]string, 0, messages)
	for i := range batches {
		msgs := make([]*message.Message, messages/batches)
		for j := range msgs {
			msgs[j] = newMsg(fmt.Sprintf("%d-%d", i, j))
			published = append(published, msgs[j].UUID)
		}
		b.publishInTx(t, topic, true, msgs...)
	}

	bin := buildConsumer(t)
	handledBy := func(worker string) int {
		return b.count(t, `SELECT count(*) FROM `+b.Schema+`.handled WHERE worker = $1`, worker)
	}

	first := startConsumer(t, bin, b, topic, "first")
	first.waitFor(t, "first has handled 600 messages", 30*time.Second, func() bool { return handledBy("first") >= killAfter })
	require.NoError(t, first.cmd.Process.Kill())
	<-first.done
	var ws syscall.WaitStatus
	if st, ok := first.cmd.ProcessState.Sys().(syscall.WaitStatus); ok {
		ws = st
	}
	require.True(t, ws.Signaled() && ws.Signal() == syscall.SIGKILL, "first must die of SIGKILL, got %v", first.cmd.ProcessState)
	atKill := handledBy("first")
	leftAtKill := b.outboxRows(t, topic)
	leasedAtKill := b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE lease_token IS NOT NULL`)
	require.Positive(t, leftAtKill, "first drained everything before the kill; the test proves nothing")

	second := startConsumer(t, bin, b, topic, "second")
	secondStarted := time.Now()
	// An empty outbox means the leases first held expired and second
	// reclaimed and acked those rows; also give second a whole lease period
	// so nothing it could still reclaim is missed.
	second.waitFor(t, "the outbox is empty", 45*time.Second, func() bool {
		return b.outboxRows(t, topic) == 0 && time.Since(secondStarted) > lease
	})
	require.NoError(t, second.cmd.Process.Signal(syscall.SIGTERM))
	select {
	case <-second.done:
	case <-time.After(20 * time.Second):
		t.Fatal("second did not exit within 20s of SIGTERM")
	}
	require.NoError(t, second.err, "second must exit cleanly on SIGTERM; stderr:\n%s", second.stderr.String())
	require.Equal(t, 0, second.cmd.ProcessState.ExitCode())

	// Every published message was handled at least once.
	counts := map[string]int{}
	rows, err := b.Pool.Query(ctx, `SELECT uuid, count(*) FROM `+b.Schema+`.handled GROUP BY uuid`)
	require.NoError(t, err)
	for rows.Next() {
		var id string
		var n int
		require.NoError(t, rows.Scan(&id, &n))
		counts[id] = n
	}
	require.NoError(t, rows.Err())
	for _, id := range published {
		require.GreaterOrEqual(t, counts[id], 1, "message %s was never handled", id)
	}
	byFirst, bySecond := handledBy("first"), handledBy("second")
	total := byFirst + bySecond
	t.Logf("messages=%d handled_by_first=%d (at kill %d) handled_by_second=%d distinct=%d duplicates=%d outbox_rows_at_kill=%d leased_at_kill=%d",
		messages, byFirst, atKill, bySecond, len(counts), total-messages, leftAtKill, leasedAtKill)
	require.Len(t, counts, messages, "only published messages are handled")
	require.LessOrEqual(t, total-messages, maxKillDuplicates, "duplicates beyond what the killed process held unacked")
	require.Equal(t, 0, b.outboxRows(t, topic))
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_dlq`))
}

// TestFaultKilledConsumersRowsComeBackInSeconds SIGKILLs one of two
// competing consumers mid-drain, both with a 30s lease. The rows the killed
// process held leased (in its handlers and its prefetch buffer) must reach
// the survivor long before their leases expire: its liveness lock vanished
// with its connection, the survivor's notifier saw it stay gone for a
// second (notifier.OrphanGrace), and the survivor's claim took the
// orphaned rows.
// Duplicates stay within what the killed process held unacked.
func TestFaultKilledConsumersRowsComeBackInSeconds(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const (
		messages = 6000 // a drain of seconds: the kill strikes mid-way
		topic    = "t"
		lease    = 30 * time.Second
	)
	// Leases only: held rows come back without the liveness lock
	// (TestFaultKilledHeldConsumersRowsAreDueAtOnce).
	// Handlings of 10ms: at full speed a batch's leases live a few
	// milliseconds, and a kill could find them all acked.
	victim, survivor := startCompetingConsumers(t, b, topic, messages, lease, pgoutbox.ClaimLease, "CONSUMER_HANDLE_TIME=10ms")
	// The survivor must have seen the victim alive once. (A process that
	// dies before any other saw its lock is recovered when its leases
	// expire; see the README.)
	survivor.waitSawAlive(t, b, victim)
	// Killed while it holds leases, all stamped with its liveness key: rows
	// it leased before its own notifier confirmed its lock carry no key and
	// come back only when their leases expire (the documented limit).
	// Leases it has not handled yet, too: rows it handled can be deleted
	// by an ack batch still in flight when it dies, and a kill that finds
	// only those proves nothing.
	// Read with the victim frozen, once the server ran what it had sent:
	// read after the kill, on a loaded machine, the survivor may have
	// taken them over already (its notifier needs only a second or so);
	// read while it ran, a loaded machine gave it time to ack them all
	// before the kill. A freeze that finds none: thaw and try again.
	var leasedByVictim []string
	for attempt := 0; len(leasedByVictim) == 0; attempt++ {
		require.Less(t, attempt, 20, "the victim never held leases when frozen; the test proves nothing")
		victim.waitFor(t, "the victim holds leases stamped with its key", 30*time.Second, func() bool {
			return b.count(t, `SELECT CASE WHEN count(*) FILTER (WHERE lease_holder IS NULL) = 0 THEN count(*) ELSE 0 END
  FROM `+b.Schema+`.outbox o WHERE leased_by = 'victim'
   AND NOT EXISTS (SELECT FROM `+b.Schema+`.handled h WHERE h.uuid = o.uuid)`) >= 8
		})
		require.Positive(t, b.outboxRows(t, topic), "the drain is over before the kill; the test proves nothing")
		require.NoError(t, victim.cmd.Process.Signal(syscall.SIGSTOP))
		pollUntil(t, "the server ran what the frozen victim had sent", 10*time.Second, nil, func() bool {
			return b.count(t, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND state = 'active'`,
				appName(b, victim.name)) == 0
		})
		if leasedByVictim = b.strings(t, `SELECT uuid FROM `+b.Schema+`.outbox WHERE leased_by = 'victim'`); len(leasedByVictim) == 0 {
			require.NoError(t, victim.cmd.Process.Signal(syscall.SIGCONT))
		}
	}
	require.NoError(t, victim.cmd.Process.Kill())
	killed := time.Now()
	<-victim.done
	orphaned := leftAfterTheVictim(t, b, victim, leasedByVictim)
	t.Logf("leased by the victim when it died: %d, of them acked by it afterwards: %d", len(leasedByVictim), len(leasedByVictim)-len(orphaned))
	require.NotEmpty(t, orphaned, "the victim held nothing when killed; the test proves nothing")
	defer func() {
		if t.Failed() { // what became of the victim's rows, for the next reader of a failure
			rows, err := b.Pool.Query(context.Background(), `SELECT id, leased_by, lease_holder, deliveries,
       round(extract(epoch FROM leased_until - now())::numeric, 1), lease_holder IN (`+query.LiveHolders+`)
  FROM `+b.Schema+`.outbox WHERE uuid = ANY ($1) ORDER BY id`, orphaned)
			if err != nil {
				t.Logf("the victim's rows: %v", err)
				return
			}
			defer rows.Close()
			for rows.Next() {
				v, _ := rows.Values()
				t.Logf("row id, leased_by, lease_holder, deliveries, lease left (s), holder live: %v", v)
			}
			t.Logf("of the victim's rows, gone from the outbox without the survivor handling them: %d", b.count(t, `
SELECT count(*) FROM unnest($1::text[]) u(uuid)
 WHERE NOT EXISTS (SELECT FROM `+b.Schema+`.outbox o WHERE o.uuid = u.uuid)
   AND NOT EXISTS (SELECT FROM `+b.Schema+`.handled h WHERE h.uuid = u.uuid AND h.worker = 'survivor')`, orphaned))
		}
	}()

	back, total, distinct := survivor.takeOver(t, b, topic, orphaned, killed, lease/2)
	t.Logf("orphaned_rows=%d back_after=%s (lease %s) handled=%d distinct=%d duplicates=%d",
		len(orphaned), back.Round(time.Millisecond), lease, total, distinct, total-distinct)
	require.Equal(t, messages, distinct)
	require.LessOrEqual(t, total-distinct, maxKillDuplicates)
}

// leftAfterTheVictim returns the messages of uuids that are the
// survivor's to handle after the victim was killed. The server still runs
// what the victim sent before it died, and commits it: an ack batch
// deletes rows the victim handled, which never are. Once all of its
// connections are gone, those are left out.
func leftAfterTheVictim(t *testing.T, b *bundle, victim *consumerProc, uuids []string) []string {
	t.Helper()
	pollUntil(t, "the victim's connections are gone", 30*time.Second, nil, func() bool {
		return b.count(t, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1`, appName(b, victim.name)) == 0
	})
	return b.strings(t, `SELECT u FROM unnest($1::text[]) u
 WHERE EXISTS (SELECT FROM `+b.Schema+`.outbox o WHERE o.uuid = u)
    OR EXISTS (SELECT FROM `+b.Schema+`.handled h WHERE h.uuid = u AND h.worker = 'survivor')`, uuids)
}

// startCompetingConsumers publishes messages to topic and starts two
// consumer processes on it, "victim" and "survivor", with the given lease
// and claim mode, recording what they handle in <schema>.handled; it
// returns once both handled messages.
func startCompetingConsumers(t *testing.T, b *bundle, topic string, messages int, lease time.Duration, mode pgoutbox.ClaimMode, extraEnv ...string) (victim, survivor *consumerProc) {
	t.Helper()
	b.handledTable(t)
	b.publishInTx(t, topic, true, newMsgs(messages)...)
	bin := buildConsumer(t)
	env := append([]string{"CONSUMER_LEASE=" + lease.String(), "CONSUMER_CLAIM_MODE=" + mode.String()}, extraEnv...)
	victim = startConsumer(t, bin, b, topic, "victim", env...)
	survivor = startConsumer(t, bin, b, topic, "survivor", env...)
	survivor.waitFor(t, "both are consuming", 30*time.Second, func() bool {
		return b.count(t, `SELECT count(DISTINCT worker) FROM `+b.Schema+`.handled`) == 2
	})
	return victim, survivor
}

// takeOver waits until the survivor p handled every message of uuids
// (within), then until the outbox of topic is empty, and returns how long
// after killed the first wait ended, and the handlings and distinct
// messages recorded in <schema>.handled.
func (p *consumerProc) takeOver(t *testing.T, b *bundle, topic string, uuids []string, killed time.Time, within time.Duration) (back time.Duration, total, distinct int) {
	t.Helper()
	p.waitFor(t, "the victim's messages are handled by the survivor", within, func() bool {
		return b.count(t, `SELECT count(DISTINCT uuid) FROM `+b.Schema+`.handled WHERE worker = 'survivor' AND uuid = ANY($1)`, uuids) == len(uuids)
	})
	back = time.Since(killed)
	p.waitFor(t, "the outbox is empty", 2*time.Minute, func() bool { return b.outboxRows(t, topic) == 0 })
	total = b.count(t, `SELECT count(*) FROM `+b.Schema+`.handled`)
	distinct = b.count(t, `SELECT count(DISTINCT uuid) FROM `+b.Schema+`.handled`)
	return back, total, distinct
}

// buildConsumer builds testdata/consumer into a temporary directory.
func buildConsumer(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "consumer")
	cmd := exec.Command("go", "build", "-o", bin, "./testdata/consumer")
	cmd.Dir = "." // the tests directory: the test's working directory
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "go build ./testdata/consumer:\n%s", out)
	return bin
}

// handledTable makes the table the consumer process records each message
// it handles in (uuid, worker).
func (b *bundle) handledTable(t *testing.T) {
	t.Helper()
	_, err := b.Pool.Exec(context.Background(), `CREATE TABLE `+b.Schema+`.handled (uuid text NOT NULL, worker text NOT NULL)`)
	require.NoError(t, err)
}

// consumerProc is a running consumer process; it is SIGKILLed at the end of
// the test if it is still running.
type consumerProc struct {
	name   string
	cmd    *exec.Cmd
	stdout *lineWatch
	stderr *syncBuffer
	done   chan struct{} // closed once the process exited; err is set then
	err    error
}

// appName is the application_name of a consumer process's connections.
func appName(b *bundle, worker string) string { return b.Schema + ":" + worker }

// waitSawAlive waits until p's notifier ran a liveness check after the
// other consumer's liveness lock was held: from then on p knows it alive,
// and takes its rows once the lock is gone. The check runs every
// notifier.LivenessEvery on the LISTEN connection; pg_stat_activity shows
// it as that connection's last query.
func (p *consumerProc) waitSawAlive(t *testing.T, b *bundle, other *consumerProc) {
	t.Helper()
	var since time.Time
	p.waitFor(t, other.name+"'s liveness lock is held", 30*time.Second, func() bool {
		return b.Pool.QueryRow(context.Background(), `SELECT now() FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
 WHERE l.locktype = 'advisory' AND l.classid = $1 AND l.objsubid = 2 AND l.granted AND a.application_name = $2`,
			query.LivenessClass, appName(b, other.name)).Scan(&since) == nil
	})
	for range 2 { // run, not only prepared: see checkRanSince
		p.waitFor(t, p.name+" checked liveness since", 30*time.Second, func() bool { return checkedSince(t, b, appName(b, p.name), since) })
		since = time.Now()
	}
}

func startConsumer(t *testing.T, bin string, b *bundle, topic, worker string, env ...string) *consumerProc {
	t.Helper()
	p := &consumerProc{
		name:   worker,
		cmd:    exec.Command(bin),
		stdout: &lineWatch{want: "consumer running", seen: make(chan struct{})},
		stderr: &syncBuffer{},
		done:   make(chan struct{}),
	}
	p.cmd.Env = append(os.Environ(),
		"CONSUMER_POSTGRES_DSN="+b.DSN,
		"CONSUMER_SCHEMA="+b.Schema,
		"CONSUMER_TOPIC="+topic,
		"CONSUMER_WORKER="+worker,
		"CONSUMER_MAX_IN_FLIGHT=8",
		"PGAPPNAME="+appName(b, worker), // its connections, in pg_stat_activity
	)
	p.cmd.Env = append(p.cmd.Env, env...)
	p.cmd.Stdout = p.stdout
	p.cmd.Stderr = p.stderr
	require.NoError(t, p.cmd.Start())
	go func() {
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			_ = p.cmd.Process.Kill()
			<-p.done
		}
		if t.Failed() {
			t.Logf("consumer %s stderr:\n%s", worker, p.stderr.String())
		}
	})
	select {
	case <-p.stdout.seen:
	case <-p.done:
		t.Fatalf("consumer %s exited before running: %v; stderr:\n%s", worker, p.err, p.stderr.String())
	case <-time.After(30 * time.Second):
		t.Fatalf("consumer %s did not report running within 30s", worker)
	}
	return p
}

// waitFor polls cond until it holds; it fails the test when the process
// exits first or the deadline passes.
func (p *consumerProc) waitFor(t *testing.T, what string, within time.Duration, cond func() bool) {
	t.Helper()
	pollUntil(t, what, within, func() {
		select {
		case <-p.done:
			t.Fatalf("consumer %s exited (%v) before %s; stderr:\n%s", p.name, p.err, what, p.stderr.String())
		default:
		}
	}, cond)
}

// pollUntil evaluates cond every 5ms on the test goroutine (so cond may use
// require) until it holds, and fails the test after within. check, when
// set, runs before every evaluation and may fail the test early.
func pollUntil(t *testing.T, what string, within time.Duration, check func(), cond func() bool) {
	t.Helper()
	deadline := time.NewTimer(within)
	defer deadline.Stop()
	poll := time.NewTicker(5 * time.Millisecond)
	defer poll.Stop()
	for {
		if check != nil {
			check()
		}
		if cond() {
			return
		}
		select {
		case <-deadline.C:
			t.Fatalf("not within %s: %s", within, what)
		case <-poll.C:
		}
	}
}

// lineWatch is an io.Writer that closes seen once a line equal to want was
// written.
type lineWatch struct {
	want string
	seen chan struct{}

	mu   sync.Mutex
	buf  bytes.Buffer
	once sync.Once
}

func (w *lineWatch) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf.Write(p)
	for _, line := range strings.Split(w.buf.String(), "\n") {
		if line == w.want {
			w.once.Do(func() { close(w.seen) })
		}
	}
	return len(p), nil
}

// syncBuffer is a bytes.Buffer safe for concurrent use.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.buf.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.buf.String()
}

// openIdle opens n connections of pool and leaves them idle in it.
func openIdle(t *testing.T, pool *pgxpool.Pool, n int) {
	t.Helper()
	conns := make([]*pgxpool.Conn, n)
	for i := range conns {
		var err error
		conns[i], err = pool.Acquire(context.Background())
		require.NoError(t, err)
	}
	for _, c := range conns {
		c.Release()
	}
}

// Subscribe survives pooled connections that were terminated while idle
// (an operator, a failover): it retries on a fresh connection instead of
// failing the Router's start.
func TestFaultSubscribeAfterIdleConnectionsWereTerminated(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	appName := "pgoutbox-idlekill-" + b.Schema
	pool := b.namedPool(t, appName)
	openIdle(t, pool, 3)
	var killed int
	require.NoError(t, b.Pool.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1`, appName).Scan(&killed))
	require.Equal(t, 3, killed)

	sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{Tables: b.tables, MinPollInterval: 20 * time.Millisecond, MaxPollInterval: time.Second}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	msgs, err := sub.Subscribe(ctx, "t")
	require.NoError(t, err, "Subscribe retries on a fresh connection")
	b.requireDelivered(t, msgs, "after the kill")
}

// requireDelivered publishes a message of payload to topic "t" and
// requires it to arrive on msgs, then acks it.
func (b *bundle) requireDelivered(t *testing.T, msgs <-chan *message.Message, payload string) {
	t.Helper()
	require.NoError(t, b.poolPublisher(t).Publish("t", newMsg(payload)))
	m := receive(t, msgs, 20*time.Second)
	require.Equal(t, payload, string(m.Payload))
	m.Ack()
}

// Subscribe under a storm that terminates every backend of its pool as
// soon as it shows (a failover flapping, an operator's script gone wrong): a lost
// established connection is tried again until StatementTimeout, not a
// count of tries (it failed after MaxConns+2 losses, which such a storm
// reaches within a fraction of a second, and a Router's start with it).
// A server that refuses connections still fails it soon
// (TestSubscribeAgainstADatabaseThatIsDownFailsSoon).
func TestFaultSubscribeDuringATerminationStorm(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	appName := "pgoutbox-storm-" + b.Schema
	pool := b.namedPool(t, appName)
	const idle = 4 // for the storm's first round
	openIdle(t, pool, idle)
	stop := make(chan struct{})
	var terminated, during atomic.Int64
	stormDone := make(chan struct{})
	go func() {
		defer close(stormDone)
		// A connection is ended as soon as it shows (a look every
		// millisecond), so no statement of Subscribe's gets through while
		// the storm lasts: 3 s or 40 connections ended during Subscribe,
		// which Subscribe's retries outlast whatever this machine's load.
		end := time.After(3 * time.Second)
		var pause time.Duration
		for during.Load() < 40 {
			select {
			case <-stop:
				return
			case <-end:
				return
			case <-time.After(pause):
			}
			var n int64
			if err := b.Pool.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1`, appName).Scan(&n); err == nil {
				if terminated.Add(n) > idle {
					during.Add(n)
				}
			}
			pause = time.Millisecond
			if n > 0 {
				pause = 0
			}
		}
	}()
	pollUntil(t, "the storm's first round", 10*time.Second, nil, func() bool { return terminated.Load() >= idle })
	sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{Tables: b.tables, StatementTimeout: 20 * time.Second, Lease: time.Minute, MinPollInterval: 20 * time.Millisecond, MaxPollInterval: time.Second}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	msgs, err := sub.Subscribe(ctx, "t")
	close(stop)
	<-stormDone
	require.NoError(t, err, "Subscribe rides out the storm (%d connections ended meanwhile)", during.Load())
	b.requireDelivered(t, msgs, "after the storm")
}

// Subscribe against a database that refuses connections fails soon, not
// after StatementTimeout (a minute here): its connections could not be
// made, which the retries of lost connections count.
func TestSubscribeAgainstADatabaseThatIsDownFailsSoon(t *testing.T) {
	t.Parallel()
	b := setup(t)
	px := startTCPProxy(t, b.DSN)
	pool := px.pool(t, b, "down-"+b.Schema, nil)
	px.cut() // every connection refused
	sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{Tables: b.tables, StatementTimeout: time.Minute, Lease: 3 * time.Minute}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	done := make(chan error, 1)
	go func() {
		_, err := sub.Subscribe(context.Background(), "t")
		done <- err
	}()
	select {
	case err := <-done:
		require.Error(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("Subscribe waited for StatementTimeout (a minute) on a database that refuses connections")
	}
}

// TestFaultKilledHeldConsumersRowsAreDueAtOnce SIGKILLs one of two
// competing consumers on the held path (ClaimHeld) mid-drain, with a 30s
// lease and before the survivor could see the victim's liveness lock:
// nothing but the held transactions' rollback can bring the victim's rows
// back early. The messages the victim handled whose acks were not
// committed (they were in its held transactions) reach the survivor within
// seconds, not a lease; every message is handled, duplicates within what
// the victim held.
func TestFaultKilledHeldConsumersRowsAreDueAtOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const (
		messages = 40000
		topic    = "t"
		lease    = 30 * time.Second
	)
	victim, survivor := startCompetingConsumers(t, b, topic, messages, lease, pgoutbox.ClaimHeld)
	// Handled by the victim, still in the outbox and never leased: acks
	// its held transactions had not committed. Kill while there are.
	// Rows whose hold outlived its bound became leases (more of them on a
	// loaded machine); a survivor that never saw the victim alive gets
	// those back only when the lease expires, so they are left out here
	// and only counted among the messages handled at the end.
	unackedSQL := `SELECT DISTINCT h.uuid FROM ` + b.Schema + `.handled h
		JOIN ` + b.Schema + `.outbox o ON o.uuid = h.uuid WHERE h.worker = 'victim' AND o.lease_token IS NULL`
	// Frozen, the victim keeps its transactions open: read what it holds,
	// then kill it (read after the kill, the survivor may have handled
	// those rows already). The server still runs what the victim sent
	// before the freeze (a commit of acks, a hold turned into leases), so
	// the read waits until none of its connections is active. A batch may
	// commit just before the freeze: then thaw and try again.
	var unacked []string
	for attempt := 0; len(unacked) == 0; attempt++ {
		require.Less(t, attempt, 20, "the victim never held an unacked message when frozen; the test proves nothing")
		victim.waitFor(t, "the victim holds handled, unacked messages", 30*time.Second, func() bool {
			return b.count(t, `SELECT count(*) FROM (`+unackedSQL+`) u`) > 0
		})
		require.NoError(t, victim.cmd.Process.Signal(syscall.SIGSTOP))
		pollUntil(t, "the server ran what the frozen victim had sent", 10*time.Second, nil, func() bool {
			return b.count(t, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND state = 'active'`,
				appName(b, victim.name)) == 0
		})
		if unacked = b.strings(t, unackedSQL); len(unacked) == 0 {
			require.NoError(t, victim.cmd.Process.Signal(syscall.SIGCONT))
		}
	}
	leased := b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE leased_by = 'victim'`)
	require.NoError(t, victim.cmd.Process.Kill())
	killed := time.Now()
	<-victim.done
	// A commit of acks the victim sent just before the freeze, still
	// unread in its connection's socket then (not "active"), runs now.
	unacked = leftAfterTheVictim(t, b, victim, unacked)
	require.NotEmpty(t, unacked, "the victim's last commit acked everything it held; the test proves nothing")

	t.Logf("killed the victim holding unacked_rows=%d leased_by_victim=%d", len(unacked), leased)
	back, total, distinct := survivor.takeOver(t, b, topic, unacked, killed, lease/2)
	t.Logf("unacked_rows=%d leased_by_victim=%d back_after=%s (lease %s) handled=%d distinct=%d duplicates=%d",
		len(unacked), leased, back.Round(time.Millisecond), lease, total, distinct, total-distinct)
	require.Equal(t, messages, distinct)
	require.LessOrEqual(t, total-distinct, maxKillDuplicates)
}

// TestFaultPoisonThatCrashesItsProcessIsDeadLetteredAlone publishes a
// message whose handler exits the process among 40 healthy ones, to a
// consumer with MaxInFlight 8 and MaxDeliveries 2, restarted after each
// crash. The messages in flight beside the poison at a crash are counted
// with it and come back with it; were they handed out beside it again,
// they would reach the limit with it. A redelivered row runs alone, so the
// poison alone is dead-lettered (max_deliveries), on every claim mode, and
// every healthy message is handled.
func TestFaultPoisonThatCrashesItsProcessIsDeadLetteredAlone(t *testing.T) {
	t.Parallel()
	bin := buildConsumer(t)
	for _, mode := range []pgoutbox.ClaimMode{pgoutbox.ClaimAuto, pgoutbox.ClaimLease, pgoutbox.ClaimHeld} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			const topic = "t"
			b.handledTable(t)
			healthy := newMsgs(40)
			poison := newMsg("poison")
			b.publishInTx(t, topic, true, append(append(slices.Clone(healthy[:10]), poison), healthy[10:]...)...)
			crashes := consumeThroughCrashes(t, bin, b, topic, 12, "CONSUMER_CLAIM_MODE="+mode.String(),
				"CONSUMER_MAX_DELIVERIES=2", "CONSUMER_POISON=poison", "CONSUMER_HANDLE_TIME=100ms", "CONSUMER_LEASE=2s")
			dead := b.strings(t, `SELECT uuid || ' ' || failure_reason FROM `+b.Schema+`.outbox_dlq ORDER BY id`)
			t.Logf("crashes: %d, dead letters: %v", crashes, dead)
			require.Equal(t, []string{poison.UUID + " max_deliveries"}, dead, "the poison alone is dead-lettered")
			for _, m := range healthy {
				require.Positive(t, b.count(t, `SELECT count(*) FROM `+b.Schema+`.handled WHERE uuid = $1`, m.UUID), "message %s never handled", m.Payload)
			}
		})
	}
}

// consumeThroughCrashes runs consumer processes on topic one after another,
// a new one after each crash, until the outbox holds none of the topic's
// rows, and returns how many crashed; at most processes of them.
func consumeThroughCrashes(t *testing.T, bin string, b *bundle, topic string, processes int, env ...string) (crashes int) {
	t.Helper()
	for i := 0; ; i++ {
		require.Less(t, i, processes, "the topic's rows were not done within %d processes", processes)
		p := startConsumer(t, bin, b, topic, fmt.Sprint("w", i), env...)
		exited := false
		pollUntil(t, "a crash, or every message done", time.Minute, nil, func() bool {
			select {
			case <-p.done:
				exited = true
				return true
			default:
				return b.outboxRows(t, topic) == 0
			}
		})
		if !exited {
			return crashes
		}
		crashes++
	}
}

// TestFaultARowDeliveredBeforeIsNotCountedBehindAFreshPoison: a message
// delivered once before (deliveries 1, as after a nack or a crash beside
// it) is due right after a fresh message whose handler exits the process;
// MaxInFlight 4, MaxDeliveries 2. The redelivered row was kept in the
// buffer behind the fresh one, counted by its claim while it waited, and
// the crash counted it again: after the poison's second crash both were
// over the limit, and the message that had crashed nothing, and never ran
// again, was dead-lettered beside the poison. A row that runs alone is now
// kept only with nothing ahead of it: only the poison is dead-lettered,
// and the other message is handled, on every claim mode.
func TestFaultARowDeliveredBeforeIsNotCountedBehindAFreshPoison(t *testing.T) {
	t.Parallel()
	bin := buildConsumer(t)
	for _, mode := range []pgoutbox.ClaimMode{pgoutbox.ClaimAuto, pgoutbox.ClaimLease, pgoutbox.ClaimHeld} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			const topic = "t"
			b.handledTable(t)
			poison, again := newMsg("poison"), newMsg("again")
			b.publishInTx(t, topic, true, poison, again)
			_, err := b.Pool.Exec(context.Background(), `UPDATE `+b.Schema+`.outbox SET deliveries = 1 WHERE uuid = $1`, again.UUID)
			require.NoError(t, err)
			consumeThroughCrashes(t, bin, b, topic, 8, "CONSUMER_CLAIM_MODE="+mode.String(), "CONSUMER_MAX_IN_FLIGHT=4",
				"CONSUMER_MAX_DELIVERIES=2", "CONSUMER_POISON=poison", "CONSUMER_LEASE=2s")
			require.Equal(t, []string{poison.UUID + " max_deliveries"},
				b.strings(t, `SELECT uuid || ' ' || failure_reason FROM `+b.Schema+`.outbox_dlq ORDER BY id`), "the poison alone is dead-lettered")
			require.Positive(t, b.count(t, `SELECT count(*) FROM `+b.Schema+`.handled WHERE uuid = $1`, again.UUID), "the other message is handled")
		})
	}
}

// TestFaultACrashDuringAnOrderedRetryWaitCountsNoDelivery: an ordered
// subscription (MaxInFlight 1) retries a failed message itself, keeping its
// row, after the retry policy's delay. A process killed during that wait
// had counted the retry already, which never ran: the next claim counted
// another, so an attempt was skipped, and with MaxDeliveries 2 a message
// that had only failed once was dead-lettered. The retry is counted when it
// goes out, so after the kill the row holds the one delivery that ran, and
// the next process delivers it as attempt 2, nothing dead-lettered with
// MaxDeliveries 2. The killed process sets no MaxDeliveries, so that its
// claims may hold (a limit makes every claim a lease);
// TestOrderedRetryIsCountedWhenItGoesOut asserts each claim path in one
// process.
func TestFaultACrashDuringAnOrderedRetryWaitCountsNoDelivery(t *testing.T) {
	t.Parallel()
	bin := buildConsumer(t)
	for _, mode := range []pgoutbox.ClaimMode{pgoutbox.ClaimAuto, pgoutbox.ClaimLease, pgoutbox.ClaimHeld} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			const topic = "t"
			b.handledTable(t)
			first := startConsumer(t, bin, b, topic, "w0", "CONSUMER_CLAIM_MODE="+mode.String(), "CONSUMER_MAX_IN_FLIGHT=1",
				"CONSUMER_FAIL=fails", "CONSUMER_RETRY_DELAY=1h")
			b.publishInTx(t, topic, true, newMsg("fails"))
			// The nack is written (its error recorded) while the row stays
			// the subscription's, waiting out its delay.
			first.waitFor(t, "the failure recorded and the row kept", 30*time.Second, func() bool {
				return b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE last_error IS NOT NULL AND lease_token IS NOT NULL`) == 1
			})
			require.NoError(t, first.cmd.Process.Kill())
			<-first.done
			require.Equal(t, 1, b.count(t, `SELECT deliveries FROM `+b.Schema+`.outbox`), "a retry that never ran is counted")

			second := startConsumer(t, bin, b, topic, "w1", "CONSUMER_CLAIM_MODE="+mode.String(), "CONSUMER_MAX_IN_FLIGHT=1",
				"CONSUMER_MAX_DELIVERIES=2")
			second.waitFor(t, "the message handled by the next process", time.Minute, func() bool {
				return b.outboxRows(t, topic) == 0
			})
			require.Zero(t, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_dlq`), "dead-lettered after one failure")
			require.Equal(t, 1, b.count(t, `SELECT count(*) FROM `+b.Schema+`.handled WHERE worker = 'w1'`))
		})
	}
}

// Handlers that hold every connection of the subscriber's pool starve its
// claims: the error said only "context deadline exceeded", which sent
// operators to the database. It says the pool made it wait, and what to
// size.
func TestClaimsStarvedOfPoolConnectionsSaySo(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pool := b.poolWith(t, nil, func(c *pgxpool.Config) { c.MaxConns = 2 })
	logs := &logCapture{}
	sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{
		Tables: b.tables, MaxInFlight: 4, StatementTimeout: 200 * time.Millisecond,
		MinPollInterval: 20 * time.Millisecond, MaxPollInterval: 100 * time.Millisecond, ClaimMode: pgoutbox.ClaimLease,
	}, logs)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	require.NoError(t, b.poolPublisher(t).Publish("t", newMsgs(2)...))
	release := make(chan struct{})
	defer close(release) // before the Router's Close, which waits for the handlers
	holding := make(chan struct{}, 3)
	runRouter(t, sub, "t", func(m *message.Message) error {
		conn, err := pool.Acquire(m.Context()) // a handler's own query, as tx.Middleware's
		if err != nil {
			return err
		}
		defer conn.Release()
		holding <- struct{}{}
		<-release
		return nil
	})
	<-holding
	<-holding
	require.NoError(t, b.poolPublisher(t).Publish("t", newMsg("more")))
	pollUntil(t, "a claim failing for want of a connection", 10*time.Second, nil, func() bool {
		return len(logs.find("error", func(e logEntry) bool {
			return e.msg == "Claim failed; retrying" && e.err != nil &&
				strings.Contains(e.err.Error(), "no connection of the subscriber's pool came free in time (2 of 2 in use)")
		})) > 0
	})
}

// A claim that waits behind an exclusive lock on the outbox (a
// migration's, a VACUUM FULL) said only "context deadline exceeded", as
// one a pooler's queue holds: it says what may hold it. Once the lock is
// gone, claims go on.
func TestClaimsWithoutAnAnswerSayWhatMayHoldThem(t *testing.T) {
	t.Parallel()
	onEachClaimPath(t, func(t *testing.T, path string) {
		b := setup(t)
		logs := &logCapture{}
		cfg := pgoutbox.SubscriberConfig{
			Tables: b.tables, StatementTimeout: 200 * time.Millisecond,
			MinPollInterval: 20 * time.Millisecond, MaxPollInterval: 100 * time.Millisecond,
		}
		onPath(t, path, &cfg)
		sub, err := pgoutbox.NewSubscriber(b.Pool, cfg, logs)
		require.NoError(t, err)
		t.Cleanup(func() { _ = sub.Close() })
		msgs, err := sub.Subscribe(t.Context(), "t")
		require.NoError(t, err)
		lock, err := b.Pool.Begin(t.Context())
		require.NoError(t, err)
		defer func() { _ = lock.Rollback(context.Background()) }()
		_, err = lock.Exec(t.Context(), `LOCK TABLE `+b.Schema+`.outbox IN ACCESS EXCLUSIVE MODE`)
		require.NoError(t, err)
		pollUntil(t, "a claim failing behind the lock, saying what may hold it", 10*time.Second, nil, func() bool {
			return len(logs.find("error", func(e logEntry) bool {
				return e.msg == "Claim failed; retrying" && e.err != nil && errors.Is(e.err, context.DeadlineExceeded) &&
					strings.Contains(e.err.Error(), "a session may hold or await an exclusive lock on the outbox")
			})) > 0
		})
		require.NoError(t, lock.Rollback(t.Context()))
		sent := newMsg("after the lock")
		require.NoError(t, b.poolPublisher(t).Publish("t", sent))
		got := receive(t, msgs, 10*time.Second)
		require.Equal(t, sent.UUID, got.UUID)
		got.Ack()
	})
}

// subscriberOnPoolOfTwo is a subscriber on a pool of two connections of
// the test's own, with a StatementTimeout of 300 ms.
func (b *bundle) subscriberOnPoolOfTwo(t *testing.T) (*pgxpool.Pool, *pgoutbox.Subscriber) {
	t.Helper()
	pool := b.poolWith(t, nil, func(c *pgxpool.Config) { c.MaxConns = 2 })
	sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{Tables: b.tables, StatementTimeout: 300 * time.Millisecond}, b.logger)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	return pool, sub
}

// A Subscribe whose pool is all held by handlers (a Router's first
// handlers already at work when it subscribes its next) said only
// "context deadline exceeded", after waiting a StatementTimeout as many
// times as the pool has connections, plus two: a Router's start failed
// late, naming nothing. It says the pool made it wait, once, on the
// first Subscribe of a subscriber and on a later one.
func TestSubscribeStarvedOfPoolConnectionsSaysSo(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pool, sub := b.subscriberOnPoolOfTwo(t)
	for _, topic := range []string{"first", "later"} {
		if topic == "later" {
			_, err := sub.Subscribe(t.Context(), "free") // the schema checked while the pool was free
			require.NoError(t, err)
		}
		var held []*pgxpool.Conn
		for len(held) < 2 {
			conn, err := pool.Acquire(context.Background())
			require.NoError(t, err)
			held = append(held, conn)
		}
		start := time.Now()
		_, err := sub.Subscribe(t.Context(), topic)
		took := time.Since(start)
		for _, c := range held {
			c.Release() // before any assertion: the pool's Close waits for them
		}
		require.ErrorContains(t, err, "no connection of the subscriber's pool came free in time (2 of 2 in use)")
		require.Less(t, took, 4*300*time.Millisecond, "given up after one wait, not one per connection and two")
	}
}

// A wait for a connection the pool was still making (the network held
// back what the subscriber sent) said that handlers held every connection
// of the pool, with one of four in use: it says that the connection was
// not made, on Subscribe and on a running subscription's claims.
func TestAConnectionThatCannotBeMadeIsNotBlamedOnThePool(t *testing.T) {
	t.Parallel()
	b := setup(t)
	px := startTCPProxy(t, b.DSN)
	pool := px.pool(t, b, "unmade-"+b.Schema, func(c *pgxpool.Config) { c.MaxConns = 4 })
	logs := &lockedBuffer{}
	sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{Tables: b.tables, StatementTimeout: 300 * time.Millisecond},
		watermill.NewStdLoggerWithOut(logs, false, false))
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	_, err = sub.Subscribe(t.Context(), "running")
	require.NoError(t, err)
	pool.Reset() // its connections closed: every statement needs a new one

	px.hold(time.Hour)
	_, err = sub.Subscribe(t.Context(), "t")
	require.ErrorContains(t, err, "a new connection to the database was not made")
	require.NotContains(t, err.Error(), "handlers holding connections")
	pollUntil(t, "a claim's failure logged", 10*time.Second, nil, func() bool {
		return strings.Contains(logs.String(), "Claim failed")
	})
	require.NotContains(t, logs.String(), "handlers holding connections")
}

// A Subscribe statement that has its connection and waits on the server
// (a lock on the outbox's bindings here), while a handler holds the pool's
// other connection, is not a pool that made it wait: the connection it
// times out on still counted as in use, and the error blamed the pool.
func TestSubscribeWaitingOnTheServerDoesNotBlameThePool(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pool, sub := b.subscriberOnPoolOfTwo(t)
	_, err := sub.Subscribe(t.Context(), "free") // the schema checked
	require.NoError(t, err)
	lock, err := b.Pool.Begin(context.Background())
	require.NoError(t, err)
	t.Cleanup(func() { _ = lock.Rollback(context.Background()) })
	_, err = lock.Exec(context.Background(), `LOCK TABLE `+b.Schema+`.outbox_bindings IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	handler, err := pool.Acquire(context.Background())
	require.NoError(t, err)
	_, err = sub.Subscribe(t.Context(), "locked")
	handler.Release()
	require.Error(t, err)
	require.NotContains(t, err.Error(), "no connection of the subscriber's pool came free")
}

// Subscriptions that share a pool of as many connections as they are, all
// idle (a CQRS service's event handlers on pgxpool's default of four): a
// publish wakes every group of its topic at once, and each empty lease
// claim held its connection while it took a second one to ask when the
// next row is due (a keyed one, to check its keys). They waited for each
// other until StatementTimeout (10 s by default), and so did everything
// else on the pool: publishes, Subscribe. One subscription on a pool of one
// waited at every empty claim. A claim now asks on its own connection.
// StatementTimeout is long here, so that a wait for a second connection
// cannot end in time.
func TestIdleSubscriptionsAsManyAsThePoolsConnectionsDoNotWaitForEachOther(t *testing.T) {
	t.Parallel()
	for _, groups := range []int{1, 4} {
		t.Run(fmt.Sprint(groups, " on ", groups), func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			ctx := context.Background()
			cfg, err := pgxpool.ParseConfig(b.DSN)
			require.NoError(t, err)
			cfg.MaxConns = int32(groups)
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			require.NoError(t, err)
			t.Cleanup(pool.Close)
			names := make([]string, groups)
			for i := range names {
				names[i] = fmt.Sprint("g", i)
			}
			_, err = pgoutbox.BindGroups(ctx, tx.FromPgxPool(pool), b.tables, "t", names)
			require.NoError(t, err)
			got := make(chan string, 4*groups)
			for _, g := range names {
				sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{
					Tables: b.tables, ConsumerGroup: g, ClaimMode: pgoutbox.ClaimLease,
					StatementTimeout: 2 * time.Minute, Lease: 5 * time.Minute,
				}, b.logger)
				require.NoError(t, err)
				t.Cleanup(func() { _ = sub.Close() })
				msgs, err := sub.Subscribe(ctx, "t")
				require.NoError(t, err)
				go func() {
					for m := range msgs {
						got <- g + "/" + string(m.Payload)
						m.Ack()
					}
				}()
			}
			pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(pool), pgoutbox.PublisherConfig{Tables: b.tables}, b.logger)
			require.NoError(t, err)
			for i := range 6 {
				m := newMsg(fmt.Sprint(i))
				if i%2 == 1 {
					pgoutbox.WithOrderingKey(m, "k")
				}
				require.NoError(t, pub.Publish("t", m))
				want, seen := map[string]bool{}, map[string]bool{}
				for _, g := range names {
					want[fmt.Sprint(g, "/", i)] = true
				}
				for len(seen) < groups {
					select {
					case s := <-got:
						seen[s] = true
					case <-time.After(30 * time.Second):
						t.Fatalf("message %d: delivered to %v of %d groups in 30 s; the pool: %d of %d connections acquired",
							i, seen, groups, pool.Stat().AcquiredConns(), pool.Stat().MaxConns())
					}
				}
				require.Equal(t, want, seen)
			}
		})
	}
}
