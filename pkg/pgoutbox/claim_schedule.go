package pgoutbox

import (
	"slices"
	"time"

	"github.com/jackc/pgx/v5/pgtype"
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
	askedAgain map[string]struct{}  // ended keys a full claim left without a row, asked for once more (see succeeded)
	keysDue    map[string]time.Time // keys whose next row is a retry due then: asked for from then on (see keyDue)
	keyDueNext time.Time            // the earliest of keysDue: claims before it skip the map
	lost       []claimToken         // claims whose reply was lost, oldest first; their rows go back (ReleaseClaim, see releasable)
	pf         prefetch
	scan       claimScan
	cfg        *SubscriberConfig
}

func newClaimSchedule(cfg *SubscriberConfig, now time.Time, clock serverClock) claimSchedule {
	c := claimSchedule{
		cfg:        cfg,
		want:       true,
		idlePoll:   cfg.MinPollInterval,
		gate:       newRetryGate(),
		endedKeys:  map[string]struct{}{},
		askedAgain: map[string]struct{}{},
		keysDue:    map[string]time.Time{},
		pf:         newPrefetch(cfg.MaxInFlight, cfg.MaxDeliveries == 0, now),
		scan:       newClaimScan(),
	}
	c.scan.clock = clock
	return c
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

// passedDelivered takes in a claim that passed over a row delivered
// before (claimsFreshOnly): the next claim, once it may start, scans from
// the start, without an idle wait, and asks again for the keys this one
// asked for and took nothing of: the row passed over may be one's next,
// which nothing else asks for (a row given back would have ended its
// key; this one is left as it was), and a scan from the start reaches it
// only by windows when a backlog held back by keys lies before it.
// (Expired and orphaned leases it passed over count as reclaimed: the
// look for them goes on as after a look that took some,
// claimScan.claimed.)
func (c *claimSchedule) passedDelivered(r claimResult) {
	c.scan.restart(false)
	c.want, c.idleUntil = true, time.Time{}
	c.askAgain(r)
}

// askAgain makes the next claim ask again for the keys r asked for and
// took nothing of.
func (c *claimSchedule) askAgain(r claimResult) {
	for _, k := range r.req.endedKeys {
		if !slices.ContainsFunc(r.rows, func(d *delivery) bool { return d.orderingKey == k }) {
			c.endedKeys[k] = struct{}{}
		}
	}
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
	// A late claim returns the server's time: this machine's clock
	// stepped, and the next claim goes by it.
	c.scan.clock.saw(r)
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
	if !r.req.held && !leasedNothing(r.err) {
		// The statement may have committed: its rows would stay leased
		// under a token nobody holds. Give them back (ReleaseClaim) instead
		// of letting them wait for the lease, and without counting a
		// delivery nobody saw. Like any give-back, claims wait for it and
		// then scan from the start, so the rows keep their place. (A held
		// claim's transaction rolled back, or its connection is closed,
		// which the server rolls back: nothing to give back.)
		at := r.started // the deadline's base (see releasedClaims)
		if at.IsZero() {
			at = r.req.sent
		}
		c.lost = append(c.lost, claimToken{token: r.req.token, at: at})
		c.givingBack++
		c.gen++
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
	if len(r.req.endedKeys) > 0 {
		// A full claim may have left out the next rows of some ended keys:
		// they did not fit. Those keys are asked for once more, not until
		// a claim comes back short: in a backlog every claim is full, and
		// a key with no next row at all (a key per order, used once) was
		// asked for again by every claim, each asking for every key ended
		// so far (20,000 such keys drained at 190 messages a second). A
		// row that misses its second ask too is reached by the scan's
		// pass from the start, within a second.
		full := len(r.rows) >= r.req.n || r.reclaimed > 0
		got := map[string]bool{}
		for _, d := range r.rows {
			got[d.orderingKey] = true
		}
		for _, k := range r.req.endedKeys {
			_, again := c.askedAgain[k]
			switch {
			case got[k] || !full || again:
				delete(c.askedAgain, k)
			default:
				c.askedAgain[k] = struct{}{}
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

// lostClaimMargin is how much later than its deadline's reckoning a lost
// claim's rows are given back once more, and given up on: the server's
// clock (serverClock) may have stepped since a claim last read it.
const lostClaimMargin = time.Second

// gaveBack records rows given back: a claim under way gives its rows back
// too (gen), and the next claim scans from the start, so they keep their
// place.
func (c *claimSchedule) gaveBack() {
	c.gen++
	c.scan.restart(false)
	c.want = true
}

// lostClaimRunsUntil is how long after its bound began a lost claim may
// still lease rows on the server: its deadline (query.ClaimArgs.Deadline)
// is StatementTimeout after it, by a clock that never runs late
// (serverClock), give or take lostClaimMargin.
func (c *claimSchedule) lostClaimRunsUntil() time.Duration {
	return c.cfg.StatementTimeout + lostClaimMargin
}

// releasable returns the tokens of the lost claims to release now: those
// not released yet, and those released while they might still have run
// (the network may hold a claim back, and deliver it after its release),
// once that time has passed.
func (c *claimSchedule) releasable(now time.Time) []pgtype.UUID {
	var tokens []pgtype.UUID
	for _, l := range c.lost {
		if c.toRelease(l, now) {
			tokens = append(tokens, l.token)
		}
	}
	return tokens
}

// toRelease reports whether lost claim l is to be released at now.
func (c *claimSchedule) toRelease(l claimToken, now time.Time) bool {
	return !l.released || now.Sub(l.at) >= c.lostClaimRunsUntil()
}

// releaseDue reports whether a lost claim is to be released now
// (releasable): a release written already, while the claim might still
// run, holds nothing up until its second one is due.
func (c *claimSchedule) releaseDue(now time.Time) bool {
	return slices.ContainsFunc(c.lost, func(l claimToken) bool { return c.toRelease(l, now) })
}

// recheckAt is when the earliest of the lost claims released while they
// might still have run is to be released again; zero: none. The list is
// not in that order: a held batch's end is listed when its failure came,
// a lease claim by when its bound began, which may be earlier.
func (c *claimSchedule) recheckAt() time.Time {
	var first time.Time
	for _, l := range c.lost {
		if at := l.at.Add(c.lostClaimRunsUntil()); l.released && (first.IsZero() || at.Before(first)) {
			first = at
		}
	}
	return first
}

// releasedClaims takes in the release of the lost claims of tokens. Once
// one is written, claims go on, from the start; a claim that might still
// run on the server stays to be released once more after that (it does
// not hold claims up meanwhile), the others are done. While a release
// fails, a lost claim whose rows' leases have expired anyway is given up
// on: the expired branch of any claim takes those rows. It returns how
// many releases of the oldest of them left have failed.
func (c *claimSchedule) releasedClaims(tokens []pgtype.UUID, err error, now time.Time) (tries int) {
	in := make(map[pgtype.UUID]bool, len(tokens))
	for _, t := range tokens {
		in[t] = true
	}
	freed := false
	var tried *claimToken
	kept := c.lost[:0]
	for i := range c.lost {
		l := c.lost[i]
		if !in[l.token] {
			kept = append(kept, l)
			continue
		}
		switch {
		case err == nil && now.Sub(l.at) >= c.lostClaimRunsUntil():
			// Released (again): what it gave back, if anything, lies
			// behind the cursor.
			freed = true
			if !l.released {
				c.givingBack--
			}
			continue
		case err == nil:
			if !l.released {
				l.released, freed = true, true
				c.givingBack--
			}
		case now.Sub(l.at) > c.cfg.Lease+c.lostClaimRunsUntil():
			// A lost claim starts on the server up to its deadline, and
			// its leases end a Lease after it started.
			freed = freed || !l.released
			if !l.released {
				c.givingBack--
			}
			continue
		}
		kept = append(kept, l)
		if err != nil && tried == nil {
			tried = &kept[len(kept)-1]
		}
	}
	clear(c.lost[len(kept):])
	c.lost = kept
	if tried != nil {
		tried.tries++
		tries = tried.tries
	}
	if freed {
		c.scan.restart(true)
		c.want = true
	}
	return tries
}

// keyEnded: a row with an ordering key was written (acked, nacked,
// dead-lettered) or left our hands, so the next row of its key may be
// claimable now. It may lie behind the cursor (the scan passed it while
// its predecessor was present): the next claim asks for the key's next
// row by its key.
func (c *claimSchedule) keyEnded(key string) {
	c.endedKeys[key] = struct{}{}
	delete(c.askedAgain, key) // a row of it ended again: its next is new
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
