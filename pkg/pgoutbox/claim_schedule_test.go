package pgoutbox

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/internal/notifier"
)

func newTestSchedule() claimSchedule {
	cfg := &SubscriberConfig{MinPollInterval: 10 * time.Millisecond, MaxPollInterval: time.Second, Lease: 10 * time.Second}
	return newClaimSchedule(cfg, time.Now(), serverClock{})
}

// The claim schedule alone, without a subscription: busy claims follow
// each other at once, an empty one sleeps and backs off, a wake-up ends
// the sleep, and a failed lease claim is given back before claims go on.
func TestClaimScheduleDecidesWhenToClaim(t *testing.T) {
	t.Parallel()
	c := newTestSchedule()
	now := time.Now()
	require.False(t, c.waiting(), "the first claim is wanted")
	req := c.start(10, now, pgtype.Int8{}, func() ([]int64, bool) { return nil, false })
	require.True(t, c.waiting(), "one claim at a time")
	r := claimResult{req: req, rows: []*delivery{{claimedRow: claimedRow{id: 1}}}}
	c.next(r, c.succeeded(r), now)
	require.False(t, c.waiting(), "rows found: claim again at once")

	req = c.start(10, now, pgtype.Int8{}, func() ([]int64, bool) { return nil, false })
	r = claimResult{req: req}
	c.next(r, c.succeeded(r), now)
	require.True(t, c.waiting(), "nothing found: sleep")
	require.True(t, c.idleUntil.After(now))
	first := c.idlePoll
	c.notified(notifier.Kinds{Due: true})
	require.False(t, c.waiting(), "a wake-up ends the sleep")
	require.Equal(t, lookAgainFirst, c.lookAgain)
	require.Equal(t, first, c.idlePoll)

	req = c.start(10, now, pgtype.Int8{}, func() ([]int64, bool) { return nil, false })
	gen := c.gen
	wait := c.failed(claimResult{req: req, err: errors.New("connection reset")}, now)
	require.Positive(t, wait)
	require.Equal(t, gen+1, c.gen, "a claim under way when it failed gives its rows back")
	require.Equal(t, 1, c.givingBack)
	require.Len(t, c.lost.list, 1, "its token is released before claims go on")
	c.gate.pass(now.Add(time.Minute))
	require.True(t, c.waiting(), "the release comes first")
	releaseAt(&c, nil, now)
	require.False(t, c.waiting())
	require.True(t, c.scan.forceExpired, "and the next claim looks for expired leases")
}

// A release that keeps failing (a server restarting) counts its tries, so
// that only some of them are logged; a lost claim whose leases expired is
// given up on.
func TestClaimScheduleCountsFailedReleases(t *testing.T) {
	t.Parallel()
	c := newTestSchedule()
	now := time.Now()
	req := c.start(10, now, pgtype.Int8{}, func() ([]int64, bool) { return nil, false })
	c.failed(claimResult{req: req, err: errors.New("connection reset")}, now)
	require.Len(t, c.lost.list, 1)
	down := errors.New("the database system is starting up")
	for want := 1; want <= 3; want++ {
		require.Equal(t, want, releaseAt(&c, down, now))
	}
	require.Len(t, c.lost.list, 1, "still to release")
	require.Zero(t, releaseAt(&c, down, now.Add(c.cfg.Lease+lostClaimMargin+time.Second)), "its leases expired: given up")
	require.Empty(t, c.lost.list)
}

// A lease claim's deadline goes by the server's clock as the last claim
// read it: none before any claim returned it. A claim the server started
// after its deadline took nothing: nothing is given back for it, and the
// next claim goes by the clock it returned (this machine's stepped). A
// lost claim is given up on once it can neither start any more nor hold a
// lease: StatementTimeout and a Lease after it was sent.
func TestClaimScheduleGivesLeaseClaimsADeadlineByTheServersClock(t *testing.T) {
	t.Parallel()
	c := newTestSchedule()
	c.cfg.StatementTimeout = 4 * time.Second
	none := func() ([]int64, bool) { return nil, false }
	now := time.Now()
	req := c.start(10, now, pgtype.Int8{}, none)
	require.False(t, req.clock.deadline(now, c.cfg.StatementTimeout).Valid, "the server's clock is not known yet")
	serverAt := func(at time.Time) pgtype.Timestamptz { return pgtype.Timestamptz{Time: at, Valid: true} }
	r := claimResult{req: req, started: now, clock: clockReading{now: serverAt(now.Add(time.Hour)), answeredAt: now}}
	c.next(r, c.succeeded(r), now)

	req = c.start(10, now, pgtype.Int8{}, none)
	require.Equal(t, serverAt(now.Add(time.Hour+4*time.Second)), req.clock.deadline(now, c.cfg.StatementTimeout))
	c.failed(claimResult{req: req, err: lateClaim{late: time.Hour}, started: now, clock: clockReading{now: serverAt(now.Add(2 * time.Hour)), answeredAt: now}}, now)
	require.Empty(t, c.lost.list, "a late claim took nothing: nothing to give back")
	require.Zero(t, c.givingBack)

	c.gate.pass(now.Add(time.Minute))
	req = c.start(10, now, pgtype.Int8{}, none)
	require.Equal(t, serverAt(now.Add(2*time.Hour+4*time.Second)), req.clock.deadline(now, c.cfg.StatementTimeout), "the clock the late claim returned")
	started := now.Add(3 * time.Second) // a fan-out, a pool wait before the claim's own bound began
	c.failed(claimResult{req: req, err: errors.New("timeout: context deadline exceeded"), started: started, clock: clockReading{answeredAt: started}}, now)
	require.Len(t, c.lost.list, 1, "a claim whose reply was lost is given back")
	down := errors.New("connection refused")
	releaseAt(&c, down, started.Add(c.cfg.Lease+time.Second))
	require.Len(t, c.lost.list, 1, "it may have started up to StatementTimeout after its bound began: its leases may hold still")
	releaseAt(&c, down, now.Add(c.cfg.Lease+c.cfg.StatementTimeout+lostClaimMargin+time.Second))
	require.Len(t, c.lost.list, 1, "counted from the claim's bound, not from when it was planned")
	releaseAt(&c, down, started.Add(c.cfg.Lease+c.cfg.StatementTimeout+lostClaimMargin+time.Second))
	require.Empty(t, c.lost.list, "given up: its leases ended")
}

// An ended key is asked for by the next claim, which then reads a window.
func TestClaimScheduleAsksForEndedKeys(t *testing.T) {
	t.Parallel()
	c := newTestSchedule()
	c.want = false
	c.keyEnded("k")
	require.True(t, c.want)
	req := c.start(4, time.Now(), pgtype.Int8{}, func() ([]int64, bool) { return nil, false })
	require.Equal(t, []string{"k"}, req.endedKeys)
	require.Equal(t, minScanWindow, req.window)
	require.Empty(t, c.keys.ended)
	// A full claim that got no row of k asks for it again.
	rows := []*delivery{{claimedRow: claimedRow{id: 1, orderingKey: "x"}}, {claimedRow: claimedRow{id: 2}}, {claimedRow: claimedRow{id: 3}}, {claimedRow: claimedRow{id: 4}}}
	c.succeeded(claimResult{req: req, rows: rows})
	require.Contains(t, c.keys.ended, "k")
}

// A key a full claim left without a row is asked for once more, not by
// every claim while claims are full: in a backlog of keys used once each,
// the keys asked for grew by every key ended, each claim probing them all.
func TestClaimScheduleAsksForAKeyLeftOutOnceMore(t *testing.T) {
	t.Parallel()
	c := newTestSchedule()
	none := func() ([]int64, bool) { return nil, false }
	full := func(req claimRequest) claimResult {
		rows := make([]*delivery, req.n)
		for i := range rows {
			rows[i] = &delivery{claimedRow: claimedRow{id: int64(i + 1), orderingKey: fmt.Sprintf("other-%d", i)}}
		}
		return claimResult{req: req, rows: rows}
	}
	most := 0
	for claim := range 50 {
		for i := range 4 { // four keys end per claim, none has a next row
			c.keyEnded(fmt.Sprintf("key-%d-%d", claim, i))
		}
		req := c.start(4, time.Now(), pgtype.Int8{}, none)
		most = max(most, len(req.endedKeys))
		c.succeeded(full(req))
	}
	require.LessOrEqual(t, most, 8, "the keys ended since the last claim, and those of the claim before it once more")
	require.LessOrEqual(t, len(c.keys.askedAgain), 4)
}

// A key whose next row is a retry due later is asked for from its due
// time on, by every claim, until one returns a row of it or a grace
// passed: asking when the row ended found it not yet due.
func TestClaimScheduleAsksForARetriedKeyWhenItIsDue(t *testing.T) {
	t.Parallel()
	none := func() ([]int64, bool) { return nil, false }
	c := newTestSchedule()
	now := time.Now()
	c.keys.dueAt("k", now.Add(100*time.Millisecond))
	c.keys.dueAt("gone", now.Add(100*time.Millisecond))
	early := c.start(4, now, pgtype.Int8{}, none)
	require.Empty(t, early.endedKeys, "not due yet")
	c.succeeded(claimResult{req: early})

	due := c.start(4, now.Add(150*time.Millisecond), pgtype.Int8{}, none)
	require.ElementsMatch(t, []string{"k", "gone"}, due.endedKeys)
	c.succeeded(claimResult{req: due}) // found neither (the server's clock is behind)
	again := c.start(4, now.Add(200*time.Millisecond), pgtype.Int8{}, none)
	require.ElementsMatch(t, []string{"k", "gone"}, again.endedKeys, "asked again")
	c.succeeded(claimResult{req: again, rows: []*delivery{{claimedRow: claimedRow{id: 1, orderingKey: "k"}}}})

	late := c.start(4, now.Add(100*time.Millisecond+keyDueGrace+time.Millisecond), pgtype.Int8{}, none)
	require.Equal(t, []string{"gone"}, late.endedKeys, "k was taken; gone is asked a last time")
	c.succeeded(claimResult{req: late})
	last := c.start(4, now.Add(2*keyDueGrace), pgtype.Int8{}, none)
	require.Empty(t, last.endedKeys)
	c.succeeded(claimResult{req: last})

	// Bounded: past maxKeysDue keys, the scan's pass finds the rest.
	for i := range maxKeysDue + 10 {
		c.keys.dueAt(fmt.Sprint("k", i), now.Add(time.Hour))
	}
	require.Len(t, c.keys.due, maxKeysDue)
}

// A key that ends while a claim runs is asked for by the next claim at
// once, whatever that claim found: an empty claim's idle wait would hold
// the key (every key of a subscription that holds them all) for it.
func TestClaimScheduleClaimsAtOnceForKeysEndedDuringAClaim(t *testing.T) {
	t.Parallel()
	none := func() ([]int64, bool) { return nil, false }
	busyWindow := func(r claimResult) claimResult { // every row of the window waits for its key
		r.last = scanEnd{at: pgtype.Timestamptz{Time: time.Now(), Valid: true}, id: pgtype.Int8{Int64: 9, Valid: true}}
		return r
	}
	keyBusy := func(r claimResult) claimResult { r.keyBusy = 1; return r }
	empty := func(r claimResult) claimResult { return r }
	for name, result := range map[string]func(claimResult) claimResult{"busy window": busyWindow, "key busy": keyBusy, "empty": empty} {
		c := newTestSchedule()
		now := time.Now()
		req := c.start(4, now, pgtype.Int8{}, none)
		c.keyEnded("k") // its ack was written while the claim ran
		r := result(claimResult{req: req})
		c.next(r, c.succeeded(r), now)
		require.False(t, c.waiting(), "%s: claim again at once", name)
		require.Equal(t, []string{"k"}, c.start(4, now, pgtype.Int8{}, none).endedKeys, name)

		c = newTestSchedule()
		req = c.start(4, now, pgtype.Int8{}, none)
		r = result(claimResult{req: req})
		c.next(r, c.succeeded(r), now)
		require.True(t, c.waiting(), "%s: no key ended: wait", name)
	}
}

// The retry gate shuts for a growing backoff after each failure and opens
// at once after a success.
func TestRetryGateBacksOff(t *testing.T) {
	t.Parallel()
	g := newRetryGate()
	now := time.Now()
	require.False(t, g.shut())
	w1 := g.failed(now)
	require.True(t, g.shut())
	g.pass(now.Add(w1 / 2))
	require.True(t, g.shut(), "not before its backoff")
	g.pass(now.Add(w1))
	require.False(t, g.shut())
	var w time.Duration
	for range 6 {
		w = g.failed(now)
	}
	require.Greater(t, w, w1, "the backoff grows")
	for range 50 {
		require.LessOrEqual(t, g.failed(now), retryAtMost*3/2, "an outage's end is noticed within retryAtMost, ±50%")
	}
	g.succeeded()
	require.False(t, g.shut())
	require.Less(t, g.failed(now), time.Second, "and starts again small")
}

// failRepeatedly counts n failures at now on g and returns the last
// backoff: a gate after an outage that went on.
func failRepeatedly(g *retryGate, n int, now time.Time) time.Duration {
	var wait time.Duration
	for range n {
		wait = g.failed(now)
	}
	return wait
}

// When the server answers again (the notifier connected anew) the gate
// opens at once, and the backoff keeps its length for a failure that
// goes on all the same.
func TestRetryGateOpensWhenTheServerIsBack(t *testing.T) {
	t.Parallel()
	g := newRetryGate()
	now := time.Now()
	require.Greater(t, failRepeatedly(&g, 20, now), time.Second)
	g.serverBack(now)
	require.False(t, g.shut(), "open at once")
	require.Greater(t, g.failed(now), 500*time.Millisecond, "not reset: a failure that goes on backs off as long")
	g.serverBack(now.Add(100 * time.Millisecond))
	require.True(t, g.shut(), "a connection that keeps coming back opens it at most once per retryAtMost")
	g.serverBack(now.Add(retryAtMost))
	require.False(t, g.shut())
}

// A claim schedule opens its gate on the notifier's Connected news.
func TestClaimScheduleClaimsAtOnceWhenTheServerIsBack(t *testing.T) {
	t.Parallel()
	cfg := &SubscriberConfig{MaxInFlight: 16, MinPollInterval: time.Second}
	c := newClaimSchedule(cfg, time.Now(), serverClock{})
	now := time.Now()
	failRepeatedly(&c.gate, 20, now)
	require.True(t, c.waiting(), "shut for the backoff")
	c.notified(notifier.Kinds{Due: true})
	require.True(t, c.waiting(), "a wake-up alone does not open the gate")
	c.notified(notifier.Kinds{Due: true, Connected: true})
	require.False(t, c.waiting(), "the server is back: claim now")
}

// Failures in a row are logged as errors at first, then one per
// loggedFailuresEvery: an outage of minutes writes a few lines, not one
// per retry.
func TestRetryGateThinsOutItsErrorLog(t *testing.T) {
	t.Parallel()
	g := newRetryGate()
	now := time.Now()
	logged := 0
	for i := range 200 {
		at := now.Add(time.Duration(i) * time.Second) // a retry a second, 200 s
		g.failed(at)
		if g.shouldLog(at) {
			logged++
		}
	}
	require.Equal(t, 11, logged, "the first 5 (0-4 s), then at 34, 64, 94, 124, 154 and 184 s")
	g.succeeded()
	next := now.Add(201 * time.Second)
	g.failed(next)
	require.True(t, g.shouldLog(next), "the first failure of the next outage is logged")
}

// At close the gate opens at once and keeps its backoffs short, however
// long they had grown.
func TestRetryGateHurriesAtClose(t *testing.T) {
	t.Parallel()
	g := newRetryGate()
	now := time.Now()
	require.Greater(t, failRepeatedly(&g, 12, now), time.Second)
	g.hurry(finalRetryEvery)
	require.False(t, g.shut(), "open at once")
	for range 5 {
		require.LessOrEqual(t, g.failed(now), finalRetryEvery*12/10)
	}
}

// A held claim reads no window: a busy held scan starts again from the
// start every second, even while windowed claims were asked for (a slow
// short claim), so rows behind its cursor (a crashed consumer's, rolled
// back) are reached within a second, not at the end of the backlog.
func TestClaimScanHeldClaimsRescanEverySecond(t *testing.T) {
	t.Parallel()
	c := newClaimScan()
	start := time.Now()
	c.windowUntil = start.Add(time.Hour) // windowed claims asked for
	req := c.request(10, 0, start)
	req.held = true
	c.claimed(claimResult{req: req, rows: []*delivery{{claimedRow: claimedRow{id: 5}}}, last: scanEnd{at: pgtype.Timestamptz{Time: start, Valid: true}, id: pgtype.Int8{Int64: 5, Valid: true}}})
	require.Equal(t, int64(5), c.from.id, "the cursor moves on")
	later := start.Add(rescanEvery)
	req = c.request(10, 0, later)
	req.held = true
	c.claimed(claimResult{req: req, rows: []*delivery{{claimedRow: claimedRow{id: 9}}}, last: scanEnd{at: pgtype.Timestamptz{Time: later, Valid: true}, id: pgtype.Int8{Int64: 9, Valid: true}}})
	require.Equal(t, scanFromStart, c.from.at, "a second later the held scan starts again from the start")

	// A windowed lease pass goes on to its end instead.
	w := newClaimScan()
	w.windowUntil = start.Add(time.Hour)
	req = w.request(10, 0, start)
	w.claimed(claimResult{req: req, last: scanEnd{at: pgtype.Timestamptz{Time: start, Valid: true}, id: pgtype.Int8{Int64: 5, Valid: true}}})
	req = w.request(10, 0, later)
	require.Positive(t, req.window)
	w.claimed(claimResult{req: req, last: scanEnd{at: pgtype.Timestamptz{Time: later, Valid: true}, id: pgtype.Int8{Int64: 9, Valid: true}}})
	require.Equal(t, int64(9), w.from.id, "the windowed pass goes on")
}

// Looks for expired leases read from a bound: the first from the start,
// then from the last empty look's server time less a margin; a look that
// took some keeps the bound (more may wait behind its limit); every
// expiredFullEvery, and after restart(true), one starts from the start.
func TestClaimScanLooksForExpiredLeasesFromTheLastLook(t *testing.T) {
	t.Parallel()
	c := newClaimScan()
	start := time.Now()
	server := start.Add(-time.Hour) // the server's clock need not be the client's
	look := func(at time.Time, reclaimed int) claimRequest {
		t.Helper()
		req := c.request(10, 0, at)
		require.True(t, req.withExpired(), "a look for expired leases at %v", at.Sub(start))
		c.claimed(claimResult{req: req, reclaimed: reclaimed, clock: clockReading{now: pgtype.Timestamptz{Time: server.Add(at.Sub(start)), Valid: true}}})
		return req
	}
	require.Equal(t, scanFromStart, look(start, 0).expiredFrom, "the first look reads every expired lease")
	bound := pgtype.Timestamptz{Time: server.Add(-expiredMargin), Valid: true}
	require.Equal(t, bound, look(start.Add(rescanEvery), 3).expiredFrom, "the next reads from the first one's start")
	require.Equal(t, bound, look(start.Add(rescanEvery+time.Millisecond), 0).expiredFrom, "after a look that took some, the same bound")
	next := pgtype.Timestamptz{Time: server.Add(rescanEvery + time.Millisecond - expiredMargin), Valid: true}
	require.Equal(t, next, look(start.Add(2*rescanEvery+time.Millisecond), 0).expiredFrom, "after an empty look, its start")

	none := c.request(10, 0, start.Add(2*rescanEvery+2*time.Millisecond))
	require.False(t, none.withExpired())
	require.False(t, none.expiredFrom.Valid, "a claim that does not look passes NULL")

	require.Equal(t, scanFromStart, look(start.Add(expiredFullEvery), 0).expiredFrom, "a look from the start every expiredFullEvery")
	require.NotEqual(t, scanFromStart, look(start.Add(expiredFullEvery+rescanEvery), 0).expiredFrom)
	c.restart(true)
	require.Equal(t, scanFromStart, look(start.Add(expiredFullEvery+2*rescanEvery), 0).expiredFrom, "and after restart(true)")
}

// A vanished liveness holder's rows are looked for at the next claim,
// until a look finds none, and then 1, 3 and 7 s later (a claim the dead
// process sent may commit after the first looks).
func TestClaimScheduleLooksForAVanishedHoldersRowsAgainLater(t *testing.T) {
	t.Parallel()
	c := newTestSchedule()
	spare := func() ([]int64, bool) { return []int64{7}, true }
	now := time.Now()
	look := func(at time.Time, found int) claimRequest {
		t.Helper()
		req := c.start(10, at, pgtype.Int8{}, spare)
		r := claimResult{req: req, reclaimed: found}
		c.next(r, c.succeeded(r), at)
		return req
	}
	// The first claims look for the rows of holders that died before we
	// started, until one finds none.
	require.NotNil(t, look(now, 2).orphansOf, "the first claim looks")
	require.NotNil(t, look(now, 0).orphansOf, "and looks on while it finds some")
	require.Nil(t, look(now, 0).orphansOf, "then stops")
	require.True(t, c.scan.relooks.at.IsZero(), "no later look planned")

	c.notified(notifier.Kinds{Orphans: true})
	require.False(t, c.waiting(), "a vanished holder wakes the subscription")
	require.NotNil(t, look(now, 0).orphansOf, "the next claim looks")
	require.Equal(t, now.Add(time.Second), c.scan.relooks.at, "and plans a later look")
	require.Nil(t, look(now.Add(500*time.Millisecond), 0).orphansOf, "claims before it do not look")
	var looked []time.Duration
	for ms := 1000; ms <= 20000; ms += 250 {
		at := now.Add(time.Duration(ms) * time.Millisecond)
		if look(at, 0).orphansOf != nil {
			looked = append(looked, at.Sub(now))
		}
	}
	require.Equal(t, []time.Duration{time.Second, 3 * time.Second, 7 * time.Second}, looked)
	require.True(t, c.scan.relooks.at.IsZero(), "no look planned after the last")
}

// A holder that vanishes while a look for orphaned rows runs is looked for
// by the next claim, whatever that look found: it may have spared the
// holder, still alive when the look started.
func TestClaimScheduleLooksAgainForAHolderThatVanishedDuringALook(t *testing.T) {
	t.Parallel()
	c := newTestSchedule()
	spare := func() ([]int64, bool) { return []int64{7}, true }
	now := time.Now()
	req := c.start(10, now, pgtype.Int8{}, spare)
	require.NotNil(t, req.orphansOf)
	c.notified(notifier.Kinds{Orphans: true}) // while the look runs
	r := claimResult{req: req}
	c.next(r, c.succeeded(r), now)
	require.NotNil(t, c.start(10, now, pgtype.Int8{}, spare).orphansOf, "the next claim looks again")
}

// With arrivals, claims read them from the arrivals cursor, which moves
// past the last arrival taken and goes back to the start every second,
// also while the outbox's cursor never moves (a topic of arrivals only):
// an arrival whose transaction committed after later ones were taken is
// found within a second. A give-back sends it to the start at once, and a
// claim that reports arrivals to fan out makes the next one fan them out.
func TestClaimScanArrivalsCursor(t *testing.T) {
	t.Parallel()
	c := newClaimScan()
	start := time.Now()
	req := c.request(10, 0, start)
	require.Zero(t, req.arrivals.after)
	c.claimed(claimResult{req: req, arrivals: arrivalsTaken{last: 40}})
	require.Equal(t, scanFromStart, c.from.at, "no outbox row: the outbox's cursor stays")
	req = c.request(10, 0, start.Add(rescanEvery/2))
	require.Equal(t, int64(40), req.arrivals.after, "the next claim goes on after the last arrival")
	c.claimed(claimResult{req: req, arrivals: arrivalsTaken{last: 80}})
	req = c.request(10, 0, start.Add(rescanEvery))
	require.Equal(t, int64(80), req.arrivals.after)
	c.claimed(claimResult{req: req, arrivals: arrivalsTaken{last: 120}})
	require.Zero(t, c.request(10, 0, start.Add(rescanEvery)).arrivals.after, "a second after the last read from the start")

	c.claimed(claimResult{req: claimRequest{sent: start.Add(rescanEvery)}, arrivals: arrivalsTaken{last: 7, waiting: true}})
	require.Equal(t, int64(7), c.arrivals.after)
	require.True(t, c.request(10, 0, start.Add(rescanEvery)).arrivals.fanOut, "arrivals to fan out: the next claim fans them out first")
	c.restart(false)
	require.Zero(t, c.arrivals.after, "a give-back reads from the start")
}

// A claim that found arrivals to fan out is followed at once by one that
// fans them out; a claim that tried and fanned out nothing (another
// subscriber's fan-out of the topic was under way) waits to be woken by
// that fan-out's copies instead of trying again at claim speed.
func TestClaimScheduleFansOutArrivalsAtOnce(t *testing.T) {
	t.Parallel()
	cfg := &SubscriberConfig{MinPollInterval: 10 * time.Millisecond, MaxPollInterval: time.Second}
	now := time.Now()
	c := newClaimSchedule(cfg, now, serverClock{})
	c.next(claimResult{arrivals: arrivalsTaken{waiting: true}}, false, now)
	require.True(t, c.want, "found arrivals to fan out: claim again at once")
	c.next(claimResult{req: claimRequest{arrivals: arrivalsCursor{fanOut: true}}, arrivals: arrivalsTaken{waiting: true}}, false, now)
	require.False(t, c.want, "the fan-out moved nothing: wait")
	require.True(t, c.idleUntil.After(now))
	c.next(claimResult{req: claimRequest{arrivals: arrivalsCursor{fanOut: true}}, arrivals: arrivalsTaken{fannedOut: 5}}, false, now)
	require.True(t, c.want, "the fan-out moved arrivals: claim again at once")
}

// A lease claim takes no arrivals while held batches of the subscription
// are open (their arrivals are locked: it would take those after them); a
// held claim, or a lease claim once the batches ended, reads from the
// cursor.
func TestLeaseClaimsLeaveArrivalsToOpenHeldBatches(t *testing.T) {
	lease := claimRequest{arrivals: arrivalsCursor{after: 42}}
	require.Equal(t, int64(noArrivals), arrivalsFrom(lease, 1))
	require.Equal(t, int64(42), arrivalsFrom(lease, 0))
	held := claimRequest{arrivals: arrivalsCursor{after: 42}, held: true}
	require.Equal(t, int64(42), arrivalsFrom(held, 2))

	// The cursor does not move for a claim that took none.
	c := newClaimScan()
	now := time.Now()
	c.arrivals.after, c.arrivalsFromAt, c.fromStartAt = 42, now, now
	c.claimed(claimResult{req: claimRequest{arrivals: arrivalsCursor{after: noArrivals}, sent: now}})
	require.Equal(t, int64(42), c.arrivals.after)
}

// Rows another subscriber gave back or fanned out from the arrivals are due
// at their old place, behind a busy loop's cursor: an ordered subscription
// woken by them claims from the start, where it took later rows first
// until its once-a-second look from the start. An unordered one keeps its
// cursor (order is not its promise; the look from the start finds them).
func TestClaimScheduleOrderedScansFromTheStartForReturnedRows(t *testing.T) {
	t.Parallel()
	for _, inFlight := range []int{1, 16} {
		cfg := &SubscriberConfig{MinPollInterval: 10 * time.Millisecond, MaxPollInterval: time.Second, Lease: 10 * time.Second, MaxInFlight: inFlight}
		c := newClaimSchedule(cfg, time.Now(), serverClock{})
		now := time.Now()
		req := c.start(10, now, pgtype.Int8{}, func() ([]int64, bool) { return nil, false })
		cursor := pgtype.Int8{Int64: 7, Valid: true}
		r := claimResult{req: req, rows: []*delivery{{claimedRow: claimedRow{id: 7}}}, last: scanEnd{at: pgtype.Timestamptz{Time: now, Valid: true}, id: cursor}}
		c.next(r, c.succeeded(r), now)
		require.EqualValues(t, 7, c.scan.from.id, "busy: the next claim goes on from the cursor")
		c.notified(notifier.Kinds{Released: true})
		if inFlight == 1 {
			require.Equal(t, scanFromStart, c.scan.from.at, "ordered: from the start")
		} else {
			require.EqualValues(t, 7, c.scan.from.id, "unordered: from the cursor")
		}
	}
}

// releaseAt writes the release of what c would release at now, with the
// outcome err, and returns the tries of the oldest lost claim left.
func releaseAt(c *claimSchedule, err error, now time.Time) int {
	return c.releasedClaims(c.lost.releasable(now), err, now)
}

// The server's clock is read against the time a claim's answer came, by
// the time the claim checked its deadline where it returned one: a claim
// that waited in the server (for a lock) before that would otherwise make
// the server's clock seem behind by the wait, and the next claims'
// deadlines early.
func TestServerClockReadsTheDeadlinesCheckAgainstTheAnswer(t *testing.T) {
	t.Parallel()
	answered := time.Now()
	at := func(d time.Duration) pgtype.Timestamptz {
		return pgtype.Timestamptz{Time: answered.Add(time.Hour + d), Valid: true}
	}
	var c serverClock
	c.saw(clockReading{now: at(-900 * time.Millisecond), checkedAt: at(-2 * time.Millisecond), answeredAt: answered})
	require.Equal(t, time.Hour-2*time.Millisecond, c.ahead)
	c.saw(clockReading{now: at(-3 * time.Millisecond), answeredAt: answered})
	require.Equal(t, time.Hour-3*time.Millisecond, c.ahead, "a claim without the check's time: its now()")
	require.Equal(t, pgtype.Timestamptz{Time: answered.Add(time.Hour - 3*time.Millisecond + time.Second), Valid: true}, c.deadline(answered, time.Second))
}

// A claim the server answered with an ERROR rolled back: nothing is given
// back for it. One the server ended with a FATAL (the connection ended,
// perhaps after the commit), or the client gave up on, may have leased
// its rows: they are given back.
func TestAClaimTheServerRefusedLeasedNothing(t *testing.T) {
	t.Parallel()
	refused := claimErr(fmt.Errorf("claim: %w", &pgconn.PgError{Severity: "FEHLER", SeverityUnlocalized: "ERROR", Code: "57014"}))
	require.True(t, leasedNothing(refused))
	require.ErrorAs(t, refused, new(*pgconn.PgError), "the server's error stays reachable")
	require.False(t, leasedNothing(claimErr(&pgconn.PgError{Severity: "FATAL", Code: "57P01"})))
	require.False(t, leasedNothing(claimErr(errors.New("timeout: context deadline exceeded"))))

	c := newTestSchedule()
	now := time.Now()
	req := c.start(10, now, pgtype.Int8{}, func() ([]int64, bool) { return nil, false })
	c.failed(claimResult{req: req, err: refused, started: now}, now)
	require.Empty(t, c.lost.list)
	require.Zero(t, c.givingBack)
}

// The lost claims are listed as they were lost, not by when their second
// release is due: a held batch's end that failed at t1 is listed before a
// lease claim sent at t0 < t1 whose reply was found lost later. The
// owner's timer is armed for the earliest second release, the claim's,
// not the batch's, a StatementTimeout later.
func TestClaimScheduleRechecksTheEarliestReleasedClaim(t *testing.T) {
	c := newTestSchedule()
	c.cfg.StatementTimeout = 4 * time.Second
	t0 := time.Now()
	req := c.start(10, t0, pgtype.Int8{}, func() ([]int64, bool) { return nil, false })
	t1 := t0.Add(3 * time.Second)
	c.lostClaim(pgtype.UUID{Bytes: uuid.New(), Valid: true}, t1) // as heldFailed lists it
	failedAt := t0.Add(c.cfg.StatementTimeout)
	c.failed(claimResult{req: req, err: errors.New("timeout: context deadline exceeded"), started: t0}, failedAt)
	require.Len(t, c.lost.list, 2)
	releaseAt(&c, nil, failedAt) // both released once
	due := t0.Add(c.cfg.StatementTimeout + lostClaimMargin)
	require.Equal(t, []pgtype.UUID{req.token}, c.lost.releasable(due), "the lease claim's second release is due")
	require.Equal(t, due, c.lost.recheckAt(), "the owner's timer is armed for it")
}

// Connections killed one after another: each claim fails once and the
// next succeeds. Each failure was logged as an error, ~7 lines a second a
// subscription in a kill storm; the gate's budget keeps it to the first
// few in each half minute.
func TestRetryGateLogsFewOfFailuresThatSuccessesSplit(t *testing.T) {
	t.Parallel()
	g := newRetryGate()
	now := time.Now()
	logged := 0
	for i := range 100 { // 20 s: a failure and a success every 200 ms
		at := now.Add(time.Duration(i) * 200 * time.Millisecond)
		g.failed(at)
		if g.shouldLog(at) {
			logged++
		}
		g.succeeded()
	}
	require.Equal(t, loggedFailures, logged)
	later := now.Add(loggedFailuresEvery + time.Second)
	g.failed(later)
	require.True(t, g.shouldLog(later), "the next half minute logs again")
}
