package pgoutbox

import (
	"slices"
	"time"

	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgoutbox/watermill-pgoutbox/internal/logbudget"
)

// lostClaims are the claims whose reply was lost, oldest first: their rows
// may be leased under a token nobody holds, so they go back
// (ReleaseClaim). Part of claimSchedule: only the owner touches it.
type lostClaims struct {
	list   []claimToken
	cfg    *SubscriberConfig
	logged logbudget.Budget // the failed releases' error lines
}

// claimToken is the token of a claim whose reply was lost.
type claimToken struct {
	token    pgtype.UUID
	at       time.Time
	tries    int  // releases of it that failed
	released bool // a release was written while the claim might still run (lostClaims.releasable)
}

// lostClaimMargin is how much later than its deadline's reckoning a lost
// claim's rows are given back once more, and given up on: the server's
// clock (serverClock) may have stepped since a claim last read it.
const lostClaimMargin = time.Second

// runsUntil is how long after its bound began a lost claim may still
// lease rows on the server: its deadline (query.ClaimArgs.Deadline) is
// StatementTimeout after it, by a clock that never runs late
// (serverClock), give or take lostClaimMargin.
func (l *lostClaims) runsUntil() time.Duration {
	return l.cfg.StatementTimeout + lostClaimMargin
}

func (l *lostClaims) add(token pgtype.UUID, at time.Time) {
	l.list = append(l.list, claimToken{token: token, at: at})
}

// releasable returns the tokens of the lost claims to release now: those
// not released yet, and those released while they might still have run
// (the network may hold a claim back, and deliver it after its release),
// once that time has passed.
func (l *lostClaims) releasable(now time.Time) []pgtype.UUID {
	var tokens []pgtype.UUID
	for _, c := range l.list {
		if l.toRelease(c, now) {
			tokens = append(tokens, c.token)
		}
	}
	return tokens
}

// toRelease reports whether lost claim c is to be released at now.
func (l *lostClaims) toRelease(c claimToken, now time.Time) bool {
	return !c.released || now.Sub(c.at) >= l.runsUntil()
}

// due reports whether a lost claim is to be released now (releasable): a
// release written already, while the claim might still run, holds
// nothing up until its second one is due.
func (l *lostClaims) due(now time.Time) bool {
	return slices.ContainsFunc(l.list, func(c claimToken) bool { return l.toRelease(c, now) })
}

// recheckAt is when the earliest of the lost claims released while they
// might still have run is to be released again; zero: none. The list is
// not in that order: a held batch's end is listed when its failure came,
// a lease claim by when its bound began, which may be earlier.
func (l *lostClaims) recheckAt() time.Time {
	var first time.Time
	for _, c := range l.list {
		if at := c.at.Add(l.runsUntil()); c.released && (first.IsZero() || at.Before(first)) {
			first = at
		}
	}
	return first
}

// released takes in the release of the lost claims of tokens. A claim
// that might still run on the server stays to be released once more after
// that; the others are done. While a release fails, a lost claim whose
// rows' leases have expired anyway is given up on: the expired branch of
// any claim takes those rows. It returns how many releases of the oldest
// of them left have failed, whether rows may have come back (claims scan
// from the start), and how many claims were released or given up on for
// the first time (give-backs no longer pending).
func (l *lostClaims) released(tokens []pgtype.UUID, err error, now time.Time) (tries int, freed bool, settled int) {
	in := make(map[pgtype.UUID]bool, len(tokens))
	for _, t := range tokens {
		in[t] = true
	}
	var tried *claimToken
	kept := l.list[:0]
	for i := range l.list {
		c := l.list[i]
		if !in[c.token] {
			kept = append(kept, c)
			continue
		}
		switch {
		case err == nil && now.Sub(c.at) >= l.runsUntil():
			// Released (again): what it gave back, if anything, lies
			// behind the cursor.
			freed = true
			if !c.released {
				settled++
			}
			continue
		case err == nil:
			if !c.released {
				c.released, freed = true, true
				settled++
			}
		case now.Sub(c.at) > l.cfg.Lease+l.runsUntil():
			// A lost claim starts on the server up to its deadline, and
			// its leases end a Lease after it started.
			freed = freed || !c.released
			if !c.released {
				settled++
			}
			continue
		}
		kept = append(kept, c)
		if err != nil && tried == nil {
			tried = &kept[len(kept)-1]
		}
	}
	clear(l.list[len(kept):])
	l.list = kept
	if tried != nil {
		tried.tries++
		tries = tried.tries
	}
	return tries, freed, settled
}
