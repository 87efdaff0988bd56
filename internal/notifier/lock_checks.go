package notifier

import (
	"maps"
	"slices"
	"time"
)

// lockChecks follows the liveness keys the checks find held: a key that
// was held and then stayed missing from every check for OrphanGrace
// (counted from the check that first missed it, which ended after the lock
// went) belongs to a process that is gone. Counting time rather than
// checks keeps the grace whatever the checks' spacing (a session that
// reconnects checks at once).
//
// A key counts as missing only while this process's own checks watched:
// when they left a gap longer than KeyShownAfter (its own connection
// stalled or was cut), another process may have taken its lock again,
// shown it for KeyShownAfter and stamped rows with it, unseen. So after
// such a gap the checks count as new (first), and a key still missing is
// missing from then on; between checks, a gap that long tells nothing.
type lockChecks struct {
	first   time.Time           // when the first check ended (zero: none yet), or the first after a gap
	last    time.Time           // when the last check ended
	held    map[int64]bool      // keys held at the last check
	missing map[int64]time.Time // held before, missing since the check that ended then
}

// gapBefore reports whether this process's checks left a gap before at
// (see lockChecks).
func (c *lockChecks) gapBefore(at time.Time) bool {
	return !c.last.IsZero() && at.Sub(c.last) > KeyShownAfter
}

// add records a check that ended at at and found the keys of now held.
// gone: a key stayed missing for OrphanGrace (its rows became orphans; it
// is reported once); vanished: a key held at the check before is missing
// from this one (its holder may have died).
func (c *lockChecks) add(at time.Time, now, own map[int64]bool) (gone, vanished bool) {
	if c.missing == nil {
		c.missing = map[int64]time.Time{}
	}
	if c.first.IsZero() || c.gapBefore(at) {
		c.first = at
		for k := range c.missing {
			c.missing[k] = at
		}
	}
	c.last = at
	for k := range c.held {
		if !now[k] && !own[k] {
			vanished = true
			c.missing[k] = at
		}
	}
	for k, since := range c.missing {
		switch {
		case now[k]:
			delete(c.missing, k) // back: a blip
		case at.Sub(since) >= OrphanGrace:
			gone = true
			delete(c.missing, k) // no longer spared
		}
	}
	c.held = maps.Clone(now)
	return gone, vanished
}

// spare returns, as of at, own, the keys held at the last check, and those
// missing for less than OrphanGrace; ok is false until the checks have
// watched the locks for OrphanGrace (before, a key missing now may belong
// to a process that is reconnecting), and while the last check is older
// than KeyShownAfter (this process is not watching).
func (c *lockChecks) spare(at time.Time, own map[int64]bool) (keys []int64, ok bool) {
	if c.first.IsZero() || at.Sub(c.first) < OrphanGrace || c.gapBefore(at) {
		return nil, false
	}
	set := maps.Clone(own)
	maps.Copy(set, c.held)
	for k, since := range c.missing {
		if at.Sub(since) < OrphanGrace {
			set[k] = true
		}
	}
	return slices.Collect(maps.Keys(set)), true
}
