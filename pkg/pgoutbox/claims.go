package pgoutbox

import (
	"errors"
	"math"
	"slices"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/pgoutbox/watermill-pgoutbox/internal/errtext"
	"github.com/pgoutbox/watermill-pgoutbox/internal/notifier"
)

// claimSchedule is the claim-scheduling part of a subscription: whether a
// claim is wanted, under way or has to wait, how many rows it takes
// (prefetch) and where it scans from (claimScan), the give-backs a claim
// must not overtake, the ordering keys to ask for, the claims whose reply
// was lost. Only the owner touches it.
type claimSchedule struct {
	claiming   bool          // a claim is under way
	want       bool          // claim when there is room: the last claim found rows, or something woke us
	wokeDuring bool          // something woke us while the claim ran: an empty claim may have missed it
	lookAgain  time.Duration // next look after a publisher's wake-up, 0: none (see onNotified)
	idleUntil  time.Time     // an idle sleep ends then
	idlePoll   time.Duration // the next idle sleep
	gate       retryGate     // after a failed claim
	gen        uint64        // bumped by every give-back; a claim started before it gives its rows back too
	givingBack int           // give-backs not written yet: a claim now would overtake them
	withheld   bool          // the last claim left arrivals to open held batches and found nothing else
	endedKeys  map[string]struct{}
	keysDue    map[string]time.Time // keys whose next row is a retry due then: asked for from then on (see keyDue)
	keyDueNext time.Time            // the earliest of keysDue: claims before it skip the map
	lost       []claimToken         // claims whose reply was lost; their rows go back (ReleaseClaim)
	pf         prefetch
	scan       claimScan
	cfg        *SubscriberConfig
}

func newClaimSchedule(cfg *SubscriberConfig, now time.Time) claimSchedule {
	return claimSchedule{
		cfg:       cfg,
		want:      true,
		idlePoll:  cfg.MinPollInterval,
		gate:      newRetryGate(),
		endedKeys: map[string]struct{}{},
		keysDue:   map[string]time.Time{},
		pf:        newPrefetch(cfg.MaxInFlight, cfg.MaxDeliveries == 0, now),
		scan:      newClaimScan(),
	}
}

// notified takes in what the notifier reported: rows due, rows scheduled
// (an empty claim plans the sleep anew, NextDue), rows another subscriber
// of this group returned, or a vanished liveness lock (look for orphaned
// rows).
func (c *claimSchedule) notified(k notifier.Kinds) {
	if k.Orphans {
		c.scan.holderGone()
	}
	if k.Vanished || (k.Released && c.cfg.MaxInFlight == 1) {
		// A process may have died: the rows of its held transactions are
		// due again, behind a busy loop's cursor. So are rows another
		// subscriber returned, or fanned out from the arrivals (due at
		// their arrival): an ordered subscription takes them now, not
		// after later rows until its once-a-second look from the start.
		c.scan.restart(false)
	}
	if k.Due {
		// Publishers notify once per cooldown (PublisherConfig.
		// NotifyCooldown): rows of the quiet publishes right after this
		// one are found by a look again shortly after.
		c.lookAgain = lookAgainFirst
	}
	c.wake(false)
}

// After a wake-up by a publisher, an idle subscription looks again
// lookAgainFirst later, then at doubling intervals up to lookAgainLast
// (or its idle poll interval, when that is shorter): a row published
// quietly right after the notifying one waits about a cooldown, and one
// whose transaction commits later is found within about the time it took
// to commit, not a poll interval. Each look is one claim that finds
// nothing, and it stops at the first idle poll.
const (
	lookAgainFirst = 2 * DefaultNotifyCooldown
	lookAgainLast  = 512 * time.Millisecond
)

// wake makes the next claim happen as soon as there is room. An idle loop
// scans from the start then: whatever woke it (a commit of a transaction
// that began before rows it claimed, a released lease) may lie behind the
// cursor; a busy loop scans from the start every second anyway.
func (c *claimSchedule) wake(expired bool) {
	if c.claiming {
		c.wokeDuring = true
	}
	if !c.want && !c.scan.resume {
		c.scan.restart(expired)
	}
	c.scan.resume = false
	c.want = true
	c.idleUntil = time.Time{}
}

// waiting reports whether no claim may start for reasons of its own: one
// is under way, none is wanted, a give-back must be written first, or a
// failure's backoff runs.
func (c *claimSchedule) waiting() bool {
	return c.claiming || !c.want || c.givingBack > 0 || c.gate.shut()
}

// start fixes the next claim of n rows: from the cursor, asking for the
// next rows of the keys that ended, looking for orphaned rows (sparing
// the holders spare returns, once the notifier can tell) when asked.
func (c *claimSchedule) start(n int, now time.Time, holder pgtype.Int8, spare func() ([]int64, bool)) claimRequest {
	c.claiming = true
	req := c.scan.request(n, c.gen, now)
	req.holder = holder
	if len(c.keysDue) > 0 && !now.Before(c.keyDueNext) {
		c.keyDueNext = time.Time{}
		for k, at := range c.keysDue {
			switch {
			case now.Before(at):
				if c.keyDueNext.IsZero() || at.Before(c.keyDueNext) {
					c.keyDueNext = at
				}
				continue
			case now.Sub(at) > keyDueGrace:
				delete(c.keysDue, k)
			default:
				c.keyDueNext = now // due: asked again by the next claim too
			}
			c.endedKeys[k] = struct{}{}
		}
	}
	if len(c.endedKeys) > 0 {
		req.window = max(2*n, minScanWindow) // "heads" is in the windowed claim only
		for k := range c.endedKeys {
			req.endedKeys = append(req.endedKeys, k)
		}
		clear(c.endedKeys)
	}
	if c.scan.findOrphans {
		// Not before the notifier watched the locks for
		// notifier.OrphanGrace: until then it cannot tell a dead holder
		// from a reconnecting one.
		if ids, ok := spare(); ok {
			req.orphansOf = ids
		}
	}
	return req
}

// failed takes in a failed claim and returns the backoff before the next.
func (c *claimSchedule) failed(r claimResult, now time.Time) time.Duration {
	c.claiming, c.wokeDuring = false, false
	for _, k := range r.req.endedKeys { // that claim did not happen
		c.endedKeys[k] = struct{}{}
	}
	if (r.req.window == 0 || r.req.held) && now.Sub(r.req.sent) >= slowClaim {
		// A claim without a window that failed slowly (its StatementTimeout,
		// mostly) may have walked a backlog of rows held back by their keys,
		// as a slow short one does (claimScan.claimed): the same claim would
		// fail again, for as long as the backlog stays. Windows bound it.
		c.scan.windowUntil = now.Add(keyedFor)
	}
	if !r.req.held && !errors.As(r.err, new(notSent)) {
		// The statement may have committed: its rows would stay leased
		// under a token nobody holds. Give them back (ReleaseClaim) instead
		// of letting them wait for the lease, and without counting a
		// delivery nobody saw. Like any give-back, claims wait for it and
		// then scan from the start, so the rows keep their place. (A held
		// claim's transaction rolled back, or its connection is closed,
		// which the server rolls back: nothing to give back.)
		c.lost = append(c.lost, claimToken{token: r.req.token, at: r.req.sent})
		c.givingBack++
		c.gen++
		if r.req.orphansOf != nil {
			c.scan.findOrphans = true // that look did not happen
		}
	}
	return c.gate.failed(now)
}

// succeeded takes in a claim that ran, and reports whether something
// woke the subscription while it ran.
func (c *claimSchedule) succeeded(r claimResult) (woke bool) {
	woke = c.wokeDuring
	c.claiming, c.wokeDuring = false, false
	c.gate.succeeded()
	c.scan.claimed(r)
	if len(c.keysDue) > 0 {
		for _, d := range r.rows {
			delete(c.keysDue, d.orderingKey)
		}
	}
	if len(r.req.endedKeys) > 0 && (len(r.rows) >= r.req.n || r.reclaimed > 0) {
		// The claim was full: the next rows of some ended keys may not have
		// fit. Ask again for the keys that got none.
		got := map[string]bool{}
		for _, d := range r.rows {
			got[d.orderingKey] = true
		}
		for _, k := range r.req.endedKeys {
			if !got[k] {
				c.endedKeys[k] = struct{}{}
			}
		}
	}
	return woke
}

// next decides, after a claim whose rows were taken, when to claim again:
// at once while claims find rows, else after an idle wait.
func (c *claimSchedule) next(r claimResult, woke bool, now time.Time) {
	// Arrivals found to fan out are fanned out by the next claim, at once;
	// one that fanned out nothing (another subscriber's fan-out held the
	// topic) waits to be woken by that one's copies.
	if len(r.rows) > 0 || r.transferred > 0 || (r.shared && !r.req.transfer) {
		c.want, c.idlePoll = true, c.cfg.MinPollInterval
		if c.lookAgain > 0 {
			// Still busy after a publisher's wake-up: quiet publishes may
			// keep coming, keep looking again after the claims run dry.
			c.lookAgain = lookAgainFirst
		}
		return
	}
	// Keys ended while this claim ran (keyEnded): it could not ask for
	// their next rows, the next claim does, at once. An idle wait here
	// would hold each of those keys for it (MinPollInterval at least),
	// every key of a subscription that holds them all, at every turn.
	ended := len(c.endedKeys) > 0
	if r.keyBusy > 0 {
		// Keyed rows whose key another claim took meanwhile: look again
		// after the shortest idle wait, from the start, not at claim speed.
		c.scan.restart(false)
		c.idleWait(ended, now)
		return
	}
	if woke {
		// The wake-up may announce a row committed after this claim's
		// snapshot: claim again instead of sleeping.
		c.scan.restart(false)
		c.want = true
		return
	}
	if r.cursor.Valid && r.free > 0 {
		// Competitors' claims had locked the rows of the window: the
		// cursor moved past them, go on at once.
		c.want = true
		return
	}
	if r.cursor.Valid {
		// Every row of the window waits for its key (held here or by a
		// competitor): go on from the cursor after the shortest idle wait,
		// so a backlog of held keys is read one window per wait, not at
		// claim speed. An ended key's next row is asked for directly.
		c.scan.resume = true
		c.idleWait(ended, now)
		return
	}
	if ended {
		c.want = true
		return
	}
	c.want = false
	var wait time.Duration
	if c.lookAgain > 0 && c.lookAgain < c.idlePoll && c.lookAgain <= lookAgainLast {
		wait = c.lookAgain
		c.lookAgain *= 2
	} else {
		c.lookAgain = 0
		wait = jitter(c.idlePoll)
		c.idlePoll = min(c.idlePoll*2, c.cfg.MaxPollInterval)
	}
	if r.dueIn > 0 && r.dueIn < wait {
		wait = r.dueIn
	}
	c.idleUntil = now.Add(wait)
}

// idleWait waits the shortest idle wait before the next claim, unless
// keys ended meanwhile (next).
func (c *claimSchedule) idleWait(ended bool, now time.Time) {
	c.want = ended
	if !ended {
		c.idleUntil = now.Add(c.cfg.MinPollInterval)
	}
}

// gaveBack records rows given back: a claim under way gives its rows back
// too (gen), and the next claim scans from the start, so they keep their
// place.
func (c *claimSchedule) gaveBack() {
	c.gen++
	c.scan.restart(false)
	c.want = true
}

// releasedClaims takes in the release of the first n lost claims. Once it
// is written, claims go on, from the start. While it fails, a lost claim
// whose rows' leases have expired anyway is given up on: the expired
// branch of any claim takes those rows. It returns how many releases of
// the oldest lost claim left have failed.
func (c *claimSchedule) releasedClaims(n int, err error, now time.Time) (tries int) {
	done := n
	if err != nil {
		done = 0
		for done < n && now.Sub(c.lost[done].at) > c.cfg.Lease {
			done++
		}
	}
	defer func() {
		if err != nil && len(c.lost) > 0 {
			c.lost[0].tries++
			tries = c.lost[0].tries
		}
	}()
	if done == 0 {
		return
	}
	c.lost = c.lost[done:]
	c.givingBack -= done
	c.scan.restart(true)
	c.want = true
	return
}

// keyEnded: a row with an ordering key was written (acked, nacked,
// dead-lettered) or left our hands, so the next row of its key may be
// claimable now. It may lie behind the cursor (the scan passed it while
// its predecessor was present): the next claim asks for the key's next
// row by its key.
func (c *claimSchedule) keyEnded(key string) {
	c.endedKeys[key] = struct{}{}
	c.want = true
	c.idleUntil = time.Time{}
}

// keyDue: a row of key was returned to be retried at about at (this
// process's clock). Asking for the key when the row ended found it not yet
// due, and its new due time put it behind the rest of a backlog: the
// claims' scan would reach it only at its pass's end, seconds later, its
// key waiting all along. So claims ask for the key again from at on, until
// one returns a row of it or keyDueGrace passed (the server's clock, which
// set the row's due time, may run behind ours).
func (c *claimSchedule) keyDue(key string, at time.Time) {
	if _, ok := c.keysDue[key]; !ok && len(c.keysDue) >= maxKeysDue {
		return // the scan's pass reaches it, later
	}
	c.keysDue[key] = at
	if len(c.keysDue) == 1 || at.Before(c.keyDueNext) {
		c.keyDueNext = at
	}
}

// keyDueGrace is how long after its due time a retried row's key is asked
// for (see keyDue); maxKeysDue bounds the keys remembered so (an outage
// that fails every key's message, with long retry delays: each claim
// looks through them while one is due).
const (
	keyDueGrace = time.Second
	maxKeysDue  = 1024
)

// startClaim starts a claim when one is wanted and there is room.
func (sub *subscription) startClaim(now time.Time) {
	switch {
	case sub.claims.waiting(), sub.drain.stopping, sub.hand.retry != nil, sub.backpressured(), sub.isolating(), sub.awaitingAlone():
		return
	}
	if sub.held.batchesBusy(now) {
		return // a batch ends soon: claim on the held path then
	}
	keyed := now.Before(sub.claims.scan.keyedUntil) // keyed rows seen, not just a slow claim
	n := sub.claims.pf.claimSize(sub.hand.unjudged(), now, keyed)
	if n == 0 {
		return
	}
	req := sub.claims.start(n, now, sub.holder(), sub.events.signals.waiter.Spare)
	req.held = sub.held.wantHeld(req, now, sub.claims.scan.keyedUntil, sub.poolHasSpare)
	req.arrivals = arrivalsFrom(req, len(sub.held.batches))
	go func() {
		r := sub.runners.claimer.run(req)
		sub.events.reports <- report{claim: &r}
	}()
}

// noArrivals, as a claim's arrivals cursor, takes no arrivals.
const noArrivals = math.MaxInt64

// arrivalsFrom is the arrivals cursor of a claim. A lease claim moves the
// arrivals it takes into the outbox, and a give-back leaves them there,
// where claims take them before the arrivals published before them. While
// held batches of ours are open, their arrivals are locked and a lease
// claim skips them: if its rows were then given back (an ordered nack in
// a batch), they would overtake those. So it leaves arrivals to the held
// claims until the batches end.
func arrivalsFrom(req claimRequest, openBatches int) int64 {
	if !req.held && openBatches > 0 {
		return noArrivals
	}
	return req.arrivals
}

// holder is what this process's rows are stamped with: its liveness key
// while it holds the lock, else NULL (liveness unknown: lease expiry only).
func (sub *subscription) holder() pgtype.Int8 {
	key, live := sub.events.signals.waiter.Liveness()
	return pgtype.Int8{Int64: key, Valid: live && key != 0}
}

// poolHasSpare reports whether a held claim leaves the pool a connection
// for the completer and the user.
func (sub *subscription) poolHasSpare() bool {
	st := sub.s.pool.Stat()
	return st.AcquiredConns()+2 <= st.MaxConns()
}

// onClaimed takes a claim's rows into the buffer.
func (sub *subscription) onClaimed(r claimResult) {
	now := time.Now()
	if r.err != nil {
		wait := sub.claims.failed(r, now)
		if r.req.held && now.Sub(r.req.sent) >= slowClaim {
			sub.held.failedUntil = now.Add(heldOffFor) // held claims read no window (see claimSchedule.failed)
		}
		fields := watermill.LogFields{"retry_in": wait.String(), "path": r.req.path()}
		if conflict(r.err) && sub.claims.gate.failures <= quietConflicts {
			// A row the claim was about to take changed under it: the
			// rotation of a rotating outbox moved it, or a deadlock with an
			// operator's statement. The next claim sees the row as it is.
			sub.logger.Debug("Claim met a row changed under it; claiming again", fields.Add(watermill.LogFields{"err": r.err.Error()}))
			return
		}
		sub.logger.Error("Claim failed; retrying", errtext.WithHint(r.err), fields)
		return
	}
	if r.transferErr != nil {
		sub.logger.Error("Fanning out arrivals failed; the next claim fans them out again", r.transferErr, nil)
	}
	woke := sub.claims.succeeded(r)
	// A claim that left arrivals to open held batches (arrivalsFrom) says
	// nothing of what waits: not idle.
	withheld := r.req.arrivals == noArrivals && len(r.rows) == 0
	sub.held.busy = len(r.rows) > 0 || withheld && sub.held.busy
	sub.s.obs.observe(Event{Kind: EventClaimed, Topic: sub.topic, Group: sub.cfg.ConsumerGroup, Count: len(r.rows), Path: r.req.path()})
	sub.claims.pf.claimed(r.rows)
	for _, d := range r.rows {
		d.claimedAt = at(r.req.sent)
		d.expiresAt = d.claimedAt.add(sub.cfg.Lease)
		d.batch = r.batch
		d.stamp = r.req.holder // held rows: set when their batch ends
		sub.hand.rows[d] = struct{}{}
	}
	if r.batch == nil && len(r.rows) > 0 {
		sub.stampsWritten(r.req.holder) // the lock may have been lost while the claim ran
	}
	if b := r.batch; b != nil {
		sub.held.opened(b, r.req.sent)
	}
	if sub.drain.stopping || r.req.gen != sub.claims.gen {
		// Stopping, or rows went back while this claim ran: these rows may
		// be newer than those, so they go back too, and the next claim
		// takes everything from the start, in order.
		sub.giveBack(r.rows)
		return
	}
	// Of the rows that run alone (runsAlone), one is kept at a time, and
	// nothing of the claim behind it: they would count a delivery each
	// while they wait for it, and a crash of it would count them. They go
	// back, their delivery taken back, and come again with a later claim.
	alone := sub.cfg.MaxDeliveries > 0 && (sub.isolating() || slices.ContainsFunc(sub.hand.buffer, sub.runsAlone))
	behindAlone := false
	var later []*delivery
	for _, d := range r.rows {
		switch {
		case sub.hand.guard.claimed(d) != nil: // parked: an earlier delivery of it is ours
		case behindAlone || sub.runsAlone(d) && alone:
			later = append(later, d)
		default:
			behindAlone = sub.runsAlone(d)
			alone = alone || behindAlone
			sub.hand.buffer = append(sub.hand.buffer, d)
		}
	}
	if len(later) > 0 {
		sub.giveBack(later)
	}
	sub.claims.next(r, woke, now)
	if withheld && !sub.claims.withheld {
		// Claim again, on the held path where it may, rather than sleep
		// the idle poll away while arrivals wait. Once: a claim that must
		// lease again would find the batches still open.
		sub.claims.want, sub.claims.idleUntil = true, time.Time{}
	}
	sub.claims.withheld = withheld
}

// onReleasedClaims applies the release of the first n lost claims.
func (sub *subscription) onReleasedClaims(n int, err error) {
	tries := sub.claims.releasedClaims(n, err, time.Now())
	// While the server restarts every try fails: the 1st, 2nd, 4th, 8th...
	// failure is logged, not each.
	if err != nil && tries&(tries-1) == 0 {
		sub.logger.Error("Releasing the rows of a failed claim failed; retrying", errtext.WithHint(err), watermill.LogFields{"claims": n, "tries": tries})
	}
}

// keyEnded lets the next row of d's key be asked for (claimSchedule.keyEnded);
// while stopping, by the group's other subscribers (writeJob.wakeGroup).
func (sub *subscription) keyEnded(d *delivery) {
	switch {
	case d.orderingKey == "":
	case !sub.drain.stopping:
		sub.claims.keyEnded(d.orderingKey)
	case !sub.drain.poolClosed:
		sub.writes.pending.wakeGroup = true
	}
}

// quietConflicts is how many claims in a row may fail on a conflict
// before the failures are logged as errors: one now and then is expected,
// a run of them is not.
const quietConflicts = 3

// conflict reports whether err is a serialization failure or a deadlock:
// the statement met a concurrent change, and running it again is the
// remedy.
func conflict(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "40001" || pgErr.Code == "40P01")
}
