package pgoutbox

import (
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
)

// claimRequest is one claim statement's parameters, fixed by the owner.
type claimRequest struct {
	n           int
	gen         uint64 // the owner's give-back generation when the claim started
	token       pgtype.UUID
	sent        time.Time
	from        queueCursor        // where the scan of ready rows starts
	expiredFrom pgtype.Timestamptz // look for expired leases, those that ended from then on (-infinity: all; NULL: do not look)
	window      int                // ready rows the scan reads at most; 0: the fast claim (no window)
	endedKeys   []string           // ordering keys whose rows ended: claim their next rows
	orphansOf   []int64            // look for orphaned rows, sparing these liveness keys (nil: do not look)
	vanishes    uint32             // holders seen vanishing when the claim started (see orphanRelooks)
	holder      pgtype.Int8        // our liveness key while we hold its lock, else NULL
	held        bool               // the held path (held.go): lock the rows in a transaction kept open
	arrivals    arrivalsCursor     // with arrivals: where the claim takes them from
	clock       serverClock        // gives a lease claim its deadline
	freshOnly   bool               // MaxDeliveries, messages out: lease no row delivered before (see claimsFreshOnly)
}

// queueCursor is a place in the queue's order (available_at, id): a busy
// loop's claims scan from the last ready row claimed (see query.Claim).
type queueCursor struct {
	at pgtype.Timestamptz
	id int64
}

// arrivalsCursor is where a claim takes arrivals from, with arrivals.
type arrivalsCursor struct {
	after  int64 // the last arrival a claim took (0: from the start; noArrivals: take none)
	fanOut bool  // fan out the arrivals other groups have too, first
}

// withExpired reports whether the claim looks for expired leases.
func (r claimRequest) withExpired() bool { return r.expiredFrom.Valid }

// path is the claim path the request takes (PathHeld, PathLease).
func (r claimRequest) path() string {
	if r.held {
		return PathHeld
	}
	return PathLease
}

// notSent is the error of a claim that never reached the server (no
// connection, or pgx failed before sending): it leased nothing, so
// nothing is given back for it.
type notSent struct{ error }

func (e notSent) Unwrap() error { return e.error }

// lateClaim is the error of a lease claim the server started after its
// deadline, which took nothing (query.ClaimArgs.Deadline). Its client
// sees it only when a clock stepped since the claim before, this
// machine's back or the server's forward (the next claim has the new
// clock); a claim the network held back that long is one its client gave
// up on.
type lateClaim struct{ late time.Duration }

func (e lateClaim) Error() string {
	return fmt.Sprintf("the claim came to its rows %s after its deadline and took nothing "+
		"(a clock stepped: this machine's back, or the database server's forward; or it waited in the database, for a lock, until then); the next claim goes by the clocks as they are now", e.late)
}

// pastDeadline says what a claim's failure at query.ClaimDeadline means;
// other errors are returned as they are. The claim rolled back.
func pastDeadline(err error, bound time.Duration) error {
	var pg *pgconn.PgError
	if !errors.As(err, &pg) || pg.Code != "22007" || !strings.Contains(pg.Message, query.DeadlineMarker) {
		return err
	}
	return fmt.Errorf("the claim ran in the database past its deadline (StatementTimeout %s) and took nothing: "+
		"the database was slow, or the claim waited there for a lock; %w", bound, err)
}

// leasedNothing reports whether a failed lease claim surely leased
// nothing: there is nothing to give back for it.
func leasedNothing(err error) bool {
	return errors.As(err, new(notSent)) || errors.As(err, new(lateClaim)) || errors.As(err, new(rolledBack))
}

// rolledBack is the error of a claim the server answered with an ERROR
// (a conflict, a cancellation, a timeout of its own): its transaction
// rolled back, so it leased nothing, and nothing is given back for it.
type rolledBack struct{ error }

func (e rolledBack) Unwrap() error { return e.error }

// claimErr marks err as rolledBack when the server reported it as an
// ERROR of the claim's transaction. Not a FATAL one: a server that ends
// the connection may do so after the commit.
func claimErr(err error) error {
	var pg *pgconn.PgError
	if !errors.As(err, &pg) {
		return err
	}
	severity := pg.SeverityUnlocalized
	if severity == "" {
		severity = pg.Severity
	}
	if severity == "ERROR" {
		return rolledBack{err}
	}
	return err
}

// claimResult is what a claim leased, in queue order.
type claimResult struct {
	req       claimRequest
	rows      []*delivery
	last      scanEnd // the last row the scan read
	free      int     // rows of the window not held back by their ordering keys
	took      time.Duration
	reclaimed int // expired or orphaned leases taken
	// A lease claim's: when its bound began (its deadline's base: a lost
	// claim's rows are given back until they can hold a lease no more);
	// zero for a held claim.
	started  time.Time
	clock    clockReading
	dueIn    time.Duration // after an empty claim: when the next row is due (0: unknown)
	batch    *heldBatch    // the held path: the batch of the rows
	keyBusy  int           // keyed rows given back by the claim's verification: their key was busy
	passed   bool          // a fresh-only claim passed over a row delivered before (query.ClaimArgs.FreshOnly)
	arrivals arrivalsTaken
	err      error
}

// scanEnd is the last row a claim's scan read, its next cursor; id NULL:
// it read none.
type scanEnd struct {
	at pgtype.Timestamptz
	id pgtype.Int8
}

// clockReading is what a claim tells of the server's clock (serverClock).
type clockReading struct {
	now        pgtype.Timestamptz // the claim statement's now()
	checkedAt  pgtype.Timestamptz // a lease claim's: the server's time at its end (query.ClaimDeadline), or when it first checked its deadline
	answeredAt time.Time          // a lease claim's: when its answer came; zero for a held claim
}

// arrivalsTaken is what a claim did with arrivals, with arrivals.
type arrivalsTaken struct {
	last      int64 // the last arrival the claim took (0: none)
	waiting   bool  // arrivals of other groups wait: the next claim fans them out first
	fannedOut int64 // how many the fan-out before the claim moved
	fanOutErr error // the fan-out before the claim failed (the claim itself ran)
}

// sortQueueOrder sorts claimed rows into queue order (available_at, id),
// the order they are delivered in.
func sortQueueOrder(rows []*delivery) {
	sort.Slice(rows, func(i, j int) bool {
		a, b := rows[i], rows[j]
		if !a.availableAt.Equal(b.availableAt) {
			return a.availableAt.Before(b.availableAt)
		}
		return a.id < b.id
	})
}

// claimScan is where claims start scanning, and which optional branches
// they run; see query.Claim for why a busy loop scans from a cursor.
type claimScan struct {
	from         queueCursor // the last ready row claimed
	fromStartAt  time.Time   // when a claim last scanned from the start
	expiredAt    time.Time   // when a claim last looked for expired leases
	forceExpired bool
	// The next look's bound: leases that ended from then on. A look that
	// found none moves it to its own start, less a margin; a look from the
	// start (-infinity) runs first, after restart(true), and every
	// expiredFullEvery, for a lease a look skipped because it was locked.
	expiredSince  pgtype.Timestamptz
	expiredFullAt time.Time
	findOrphans   bool          // a liveness holder vanished: look for its rows (until a look finds none)
	relooks       orphanRelooks // later looks for a vanished holder's rows
	resume        bool          // the last claim read only rows it could not take: go on from the cursor
	keyedUntil    time.Time     // keyed rows were seen: hold many keys until then
	windowUntil   time.Time     // claim with a window until then (see query.ClaimFast)
	// With arrivals: the last arrival a claim took (restart: 0; like the
	// cursor, read from the start every second, for an arrival whose
	// transaction committed after later ones were taken), whether
	// arrivals wait to be fanned out, and when a claim last read them
	// from the start.
	arrivals       arrivalsCursor
	arrivalsFromAt time.Time
	clock          serverClock
}

// serverClock is how far the database server's clock runs ahead of this
// process's, at least: a statement's now() less the time its answer came,
// from Subscribe's reading, then from the last lease claim (a clock that
// steps is followed at the next claim). known: one was read.
//
// At least, so that a claim's deadline never falls after the moment its
// client gives up on it. Read against the time a statement was sent, a
// trip the network slowed (answered in time all the same) made the next
// claims' deadlines later by that trip: one of them the network then held
// back could still lease rows after its client had given them back.
type serverClock struct {
	ahead time.Duration
	known bool
}

// read takes in the server's time now, of a statement answered at
// answered.
func (c *serverClock) read(now pgtype.Timestamptz, answered time.Time) {
	if now.Valid && now.InfinityModifier == pgtype.Finite && !answered.IsZero() {
		c.ahead, c.known = now.Time.Sub(answered), true
	}
}

// saw takes in the server's time a lease claim returned.
// The time of the deadline's check when the claim returned it: later
// than now() (the transaction's start) by whatever the claim waited for
// before it, which the reading would otherwise count against the server.
func (c *serverClock) saw(r clockReading) {
	if r.checkedAt.Valid {
		c.read(r.checkedAt, r.answeredAt)
		return
	}
	c.read(r.now, r.answeredAt)
}

// deadline is a lease claim's deadline by the server's clock (see
// query.ClaimArgs.Deadline) when it is sent now and its client waits for
// it up to wait: past then its client has given up on it. NULL while the
// server's clock is not known.
func (c serverClock) deadline(now time.Time, wait time.Duration) pgtype.Timestamptz {
	if !c.known {
		return pgtype.Timestamptz{}
	}
	return pgtype.Timestamptz{Time: now.Add(c.ahead + wait), Valid: true}
}

// orphanRelooks are the looks for a vanished liveness holder's rows that a
// subscription makes after the first ones: orphanRelookFirst after them,
// then at doubling intervals (1, 3 and 7 s after). A process killed while
// its claim runs leaves that claim to the server, which runs a statement
// to its end although its client is gone: the claim may commit, leasing
// rows under the dead holder's key, after the looks that followed the
// lock's vanishing found nothing. Without a later look those rows would
// wait for their leases to end.
type orphanRelooks struct {
	vanishes uint32        // holders seen vanishing so far: a look that started before the last one does not end the looks
	left     int           // looks still to make
	at       time.Time     // the next one; zero: planned by the next claim
	in       time.Duration // from the look before to the next
}

const (
	orphanRelookCount = 3
	orphanRelookFirst = time.Second
)

// holderGone looks for a vanished liveness holder's rows at the next
// claim, until a look finds none, and orphanRelookCount times after.
func (c *claimScan) holderGone() {
	c.findOrphans = true
	c.relooks = orphanRelooks{vanishes: c.relooks.vanishes + 1, left: orphanRelookCount, in: orphanRelookFirst}
}

// relook makes the claim starting now look for orphaned rows when a
// later look is due, and plans the one after.
func (c *claimScan) relook(now time.Time) {
	r := &c.relooks
	switch {
	case r.left == 0:
	case r.at.IsZero():
		r.at = now.Add(r.in)
	case !now.Before(r.at):
		c.findOrphans = true
		r.left--
		r.in *= 2
		r.at = now.Add(r.in)
		if r.left == 0 {
			r.at = time.Time{}
		}
	}
}

// keyedFor is how long a subscription claims with a window after it last
// saw a sign of ordering keys: a keyed row, an ended key, a slow claim.
const keyedFor = 10 * time.Second

// slowClaim marks a fast claim that, when it also came back short, may
// have walked rows held back by their keys: the next claims use a window.
const slowClaim = 50 * time.Millisecond

// minScanWindow is the least number of ready rows a claim reads: room for
// rows that competitors lock, or whose ordering keys are held.
const minScanWindow = 256

// rescanEvery bounds how long a busy loop goes without scanning from the
// start, and without looking for expired leases.
const rescanEvery = time.Second

// expiredFullEvery is how often a look for expired leases starts from the
// start. Looks in between read the leases that ended since the last one:
// while a snapshot holds vacuum back, a look from the start walks the dead
// entry of every lease acked since (0.4 s a look after a minute of a soak
// at 2,000 msg/s, once a second).
const expiredFullEvery = time.Minute

// expiredMargin is how far before the last look's start the next one
// begins.
const expiredMargin = time.Second

var scanFromStart = pgtype.Timestamptz{InfinityModifier: pgtype.NegativeInfinity, Valid: true}

// newClaimScan starts from the beginning and looks for expired and orphaned
// leases first: a consumer that died before we started left them.
func newClaimScan() claimScan {
	return claimScan{from: queueCursor{at: scanFromStart}, forceExpired: true, findOrphans: true, expiredSince: scanFromStart}
}

// restart makes the next claim scan from the start, and look for expired
// leases too when asked.
func (c *claimScan) restart(expired bool) {
	c.from, c.resume, c.arrivals.after = queueCursor{at: scanFromStart}, false, 0
	c.forceExpired = c.forceExpired || expired
	if expired {
		c.expiredSince = scanFromStart
	}
}

// request fixes the next claim's parameters.
func (c *claimScan) request(n int, gen uint64, now time.Time) claimRequest {
	req := claimRequest{
		n:        n,
		gen:      gen,
		token:    pgtype.UUID{Bytes: uuid.New(), Valid: true},
		sent:     now,
		from:     c.from,
		vanishes: c.relooks.vanishes,
		arrivals: c.arrivals,
		clock:    c.clock,
	}
	if c.forceExpired || now.Sub(c.expiredAt) >= rescanEvery {
		if now.Sub(c.expiredFullAt) >= expiredFullEvery {
			c.expiredSince = scanFromStart
		}
		req.expiredFrom = c.expiredSince
		if c.expiredSince == scanFromStart {
			c.expiredFullAt = now
		}
	}
	if c.from.at == scanFromStart {
		c.fromStartAt = now
	}
	if c.arrivals.after == 0 {
		c.arrivalsFromAt = now
	}
	c.relook(now)
	if now.Before(c.windowUntil) {
		req.window = max(2*n, minScanWindow)
	}
	return req
}

// claimed moves the cursor past the last ready row of a claim, and
// schedules the next scan from the start.
func (c *claimScan) claimed(r claimResult) {
	c.clock.saw(r.clock)
	now := r.req.sent
	// A slow claim that came back short may have walked rows held back by
	// their keys; a slow full one only met a cold cache or a busy server.
	keyed := false
	for _, d := range r.rows {
		keyed = keyed || d.orderingKey != ""
	}
	if keyed {
		c.keyedUntil = now.Add(keyedFor)
	}
	if keyed || (r.took >= slowClaim && len(r.rows) < r.req.n) {
		c.windowUntil = now.Add(keyedFor)
	}
	if len(r.rows) > 0 || !r.last.id.Valid {
		c.resume = false
	}
	if r.req.withExpired() || r.req.orphansOf != nil {
		// Rows a crashed consumer held come back in a burst: keep looking
		// while the last look found some.
		c.expiredAt, c.forceExpired = now, r.reclaimed > 0
		// A look that took some may have left more behind its limit: the
		// next one reads from the same bound.
		if now := r.clock.now; r.req.withExpired() && r.reclaimed == 0 && now.Valid && now.InfinityModifier == pgtype.Finite &&
			r.req.expiredFrom == c.expiredSince {
			c.expiredSince = pgtype.Timestamptz{Time: now.Time.Add(-expiredMargin), Valid: true}
		}
		if r.req.orphansOf != nil && r.req.vanishes == c.relooks.vanishes {
			// (A holder that vanished while the look ran may have been
			// spared by it: its rows are looked for by the next claim.)
			c.findOrphans = r.reclaimed > 0
		}
	}
	// A windowed pass goes on to the end of the rows before it starts
	// again: rows deep in a backlog held back by their keys (the next row
	// of a key ended elsewhere, a new key's first row) are reached only so.
	// A held claim reads no window (the request may carry one it ignores):
	// it scans from the start every second like any unwindowed claim, or a
	// crashed consumer's rows behind its cursor wait for the backlog's end.
	c.arrivals.fanOut = r.arrivals.waiting
	if r.arrivals.last > 0 && r.req.arrivals.after == c.arrivals.after {
		c.arrivals.after = r.arrivals.last
	}
	if now.Sub(c.arrivalsFromAt) >= rescanEvery {
		c.arrivals.after = 0
	}
	windowedPass := r.req.window > 0 && !r.req.held && r.last.id.Valid
	if now.Sub(c.fromStartAt) >= rescanEvery && !windowedPass {
		c.restart(false)
		return
	}
	if !r.last.id.Valid || r.req.from != c.from {
		return // no ready row, or the scan restarted while the claim ran
	}
	c.from = queueCursor{at: r.last.at, id: r.last.id.Int64}
}
