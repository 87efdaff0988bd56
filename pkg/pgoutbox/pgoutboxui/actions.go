package pgoutboxui

import (
	"context"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/pgoutbox/watermill-pgoutbox/internal/dbclock"
	"github.com/pgoutbox/watermill-pgoutbox/internal/olderthan"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
)

// Write actions. A form posts to "confirm" (nothing changes): the page
// says what will happen to how many rows and posts the same fields to
// "do", which acts and redirects back (303) with a short result message.
// Both steps check the CSRF token; both refuse when writes are off.

type confirmData struct {
	Action   string
	What     string
	Rows     int64
	RowsNote string
	Fields   []kv
	Return   string
	Danger   bool
}

// maxIDs bounds the ids one action takes (a page of dead letters).
const maxIDs = 1000

func (ui *UI) action(w http.ResponseWriter, r *http.Request, do bool) error {
	if !ui.opts.Writes {
		return &httpError{code: http.StatusForbidden, msg: "this page is read-only: write actions are not enabled (Options.Writes, or pgoutbox ui --write)"}
	}
	r.Body = http.MaxBytesReader(w, r.Body, 1<<20)
	if err := r.ParseForm(); err != nil {
		return badRequest("the form does not parse: %v", err)
	}
	if why := ui.checkCSRF(r); why != "" {
		return &httpError{code: http.StatusForbidden, msg: "refused: " + why}
	}
	f := r.PostForm
	ret := ui.safeReturn(f.Get("return"))
	ctx := r.Context()
	act := f.Get("action")
	c := confirmData{Action: act, Return: ret}
	var result func() (string, error)
	switch act {
	case "requeue", "delete":
		ids, err := parseIDs(f["id"])
		if err != nil {
			return err
		}
		ls, err := ui.deadLettersByID(ctx, ids, 1) // only which are there
		if err != nil {
			return err
		}
		c.Rows = int64(len(ls))
		which, gone := selection(ids, ls)
		if act == "requeue" {
			c.What = fmt.Sprintf("Requeue %s: each goes back into the outbox, due at once, with its delivery count and error cleared.%s", which, gone)
			result = func() (string, error) {
				start, startErr := dbclock.Now(ctx, ui.exec)
				n, err := pgoutbox.RequeueDeadLetters(ctx, ui.exec, ui.tables, ids)
				if err != nil {
					return "", err
				}
				done := fmt.Sprintf("Requeued %s.", plural(int(n), "dead letter"))
				// A letter that failed before the statement and is still
				// there stayed; one that failed since was requeued, taken
				// by a subscriber and failed again under its id.
				var stayed int64
				if now, err := ui.deadLettersByID(ctx, ids, 1); startErr == nil && err == nil {
					for _, l := range now {
						if l.FailedAt.Before(start) {
							stayed++
						}
					}
				}
				if stayed > 0 {
					return done + " " + stayedNote(stayed), nil
				}
				topics := map[string]bool{}
				for _, l := range ls {
					topics[l.Topic] = true
				}
				if n > 0 {
					done += ui.strandedNote(ctx, slices.Sorted(maps.Keys(topics)))
				}
				if strings.Contains(ret, "dead-letter?") {
					ret = ui.opts.BasePath + "dead-letters" // its page is gone
				}
				return done, nil
			}
		} else {
			c.Danger = true
			c.What = fmt.Sprintf("Delete %s for good: nobody will ever process them.%s", which, gone)
			result = func() (string, error) {
				n, err := pgoutbox.DeleteDeadLetters(ctx, ui.exec, ui.tables, ids)
				if err == nil && strings.Contains(ret, "dead-letter?") {
					ret = ui.opts.BasePath + "dead-letters"
				}
				return fmt.Sprintf("Deleted %s.", plural(int(n), "dead letter")), err
			}
		}
	case "requeue-matching":
		flt, err := parseFilter(f)
		if err != nil {
			return err
		}
		// What fails after the count is not what the operator confirmed:
		// the action is bounded by the confirmation's time.
		if flt.f.FailedBefore, err = ui.countedBefore(ctx, do, f, &c, flt.f.FailedBefore); err != nil {
			return err
		}
		if c.Rows, err = ui.countDeadLetters(ctx, flt.f); err != nil {
			return err
		}
		c.What = "Requeue every dead letter matching " + describe(flt) + ", in one statement."
		result = func() (string, error) {
			start, startErr := dbclock.Now(ctx, ui.exec)
			n, err := pgoutbox.RequeueDeadLettersMatching(ctx, ui.exec, ui.tables, flt.f)
			if err != nil {
				return "", err
			}
			done := fmt.Sprintf("Requeued %s.", plural(int(n), "dead letter"))
			if n > 0 {
				var topics []string // every topic, unless the filter names one
				if flt.f.Topic != "" {
					topics = []string{flt.f.Topic}
				}
				done += ui.strandedNote(ctx, topics)
			}
			if left := flt.f; startErr == nil && n < c.Rows {
				// As above: the matches that failed before the statement.
				left.FailedBefore = dbclock.Before(left.FailedBefore, start)
				if stayed, err := ui.countDeadLetters(ctx, left); err == nil && stayed > 0 {
					return done + " " + stayedNote(stayed), nil
				}
			}
			return done, nil
		}
	case "purge":
		d, err := parseAge(f.Get("older_than"))
		if err != nil {
			return err
		}
		counted, err := ui.countedBefore(ctx, do, f, &c, time.Time{})
		if err != nil {
			return err
		}
		if c.Rows, err = ui.countDeadLetters(ctx, pgoutbox.DeadLetterFilter{FailedBefore: counted.Add(-d)}); err != nil {
			return err
		}
		c.Danger = true
		c.RowsNote = "counted now; those still there when it runs"
		c.What = fmt.Sprintf("Delete every dead letter, of every topic, that failed more than %s before this confirmation, for good.", ageString(d))
		if d == 0 {
			c.What = "Delete every dead letter, of every topic, that failed before this confirmation, for good."
		}
		result = func() (string, error) {
			// The purge's cutoff is the confirmation's: what failed d
			// before it counted.
			n, err := pgoutbox.PurgeDeadLettersMatching(ctx, ui.exec, ui.tables, d, pgoutbox.DeadLetterFilter{FailedBefore: counted.Add(-d)}, 0)
			return fmt.Sprintf("Purged %s.", plural(int(n), "dead letter")), err
		}
	case "pause", "resume":
		topic, group := f.Get("topic"), f.Get("group")
		st, err := pgoutbox.Stats(ctx, ui.exec, ui.tables, pgoutbox.StatsForGroup(topic, group))
		if err != nil {
			return err
		}
		s := st[0]
		who := fmt.Sprintf("group %s of topic %q", groupLabel(group), topic)
		if act == "pause" {
			c.Rows = s.Ready + s.Scheduled + s.ExpiredLeases
			c.RowsNote = fmt.Sprintf("rows that will wait; %d in flight finish", s.Leased)
			c.What = "Pause " + who + ": no subscriber of it claims anything new until resumed; messages in flight finish; publishing goes on."
			result = func() (string, error) {
				return "Paused " + who + ".", pgoutbox.PauseGroup(ctx, ui.exec, ui.tables, topic, group)
			}
		} else {
			c.Rows = s.Ready + s.ExpiredLeases
			c.RowsNote = "rows claimable at once"
			c.What = "Resume " + who + " and wake its subscribers."
			result = func() (string, error) {
				was, err := pgoutbox.ResumeGroup(ctx, ui.exec, ui.tables, topic, group)
				if err == nil && !was {
					return "The " + who + " was not paused.", nil
				}
				return "Resumed " + who + ".", err
			}
		}
	default:
		return badRequest("unknown action %q", act)
	}
	if !do {
		for k, vs := range f {
			if k == "csrf" || k == "return" || k == countedAtField {
				continue
			}
			for _, v := range vs {
				c.Fields = append(c.Fields, kv{k, v})
			}
		}
		sort.SliceStable(c.Fields, func(i, j int) bool { return c.Fields[i].K < c.Fields[j].K })
		return ui.render(w, r, "confirm", "Confirm", c)
	}
	msg, err := result()
	if err != nil {
		return err
	}
	sep := "?"
	if strings.Contains(ret, "?") {
		sep = "&"
	}
	http.Redirect(w, r, ret+sep+url.Values{"done": {msg}, "sig": {ui.sign("flash\x00" + msg)}}.Encode(), http.StatusSeeOther)
	return nil
}

// flash is the result message of the action that redirected here, shown
// only when this handler signed it (a link cannot make the page say
// anything).
func (ui *UI) flash(r *http.Request) string {
	q := r.URL.Query()
	msg := q.Get("done")
	if msg == "" || q.Get("sig") != ui.sign("flash\x00"+msg) {
		return ""
	}
	return msg
}

// safeReturn keeps a return path under BasePath, on this site.
func (ui *UI) safeReturn(s string) string {
	if !strings.HasPrefix(s, ui.opts.BasePath) || strings.Contains(s, "//") || strings.ContainsAny(s, "\\\r\n") {
		return ui.opts.BasePath
	}
	// Drop an earlier action's message.
	if u, err := url.Parse(s); err == nil {
		q := u.Query()
		q.Del("done")
		q.Del("sig")
		u.RawQuery = q.Encode()
		return u.RequestURI()
	}
	return ui.opts.BasePath
}

// selection says which dead letters of the ids given are acted on (those
// found, ls, with their topics), and how many of the ids are none.
func selection(ids []int64, ls []pgoutbox.DeadLetter) (which, gone string) {
	var topics []string
	for _, l := range ls {
		if !slices.Contains(topics, l.Topic) {
			topics = append(topics, l.Topic)
		}
	}
	for i, t := range topics {
		topics[i] = strconv.Quote(t)
	}
	s := plural(len(ls), "selected dead letter")
	if len(topics) > 0 {
		s += " of " + plural(len(topics), "topic") + " (" + strings.Join(topics, ", ") + ")"
	}
	if n := len(ids) - len(ls); n > 0 {
		gone = fmt.Sprintf(" %s of the selection %s no dead letter now.", plural(n, "id"), map[bool]string{true: "is", false: "are"}[n == 1])
	}
	return s, gone
}

func parseIDs(vs []string) ([]int64, error) {
	var ids []int64
	seen := map[int64]bool{}
	for _, v := range vs {
		for _, part := range strings.Split(v, ",") {
			part = strings.TrimSpace(part)
			if part == "" {
				continue
			}
			id, err := strconv.ParseInt(part, 10, 64)
			if err != nil || id <= 0 {
				return nil, badRequest("%q is not a dead-letter id", part)
			}
			if !seen[id] { // an id given twice is one dead letter
				seen[id] = true
				ids = append(ids, id)
			}
		}
	}
	if len(ids) == 0 {
		return nil, badRequest("no dead letters selected; tick the ones to act on")
	}
	if len(ids) > maxIDs {
		return nil, badRequest("%d dead letters selected; at most %d at once (use requeue all matching)", len(ids), maxIDs)
	}
	return ids, nil
}

// parseAge parses "30d", "12h", "90m" or any Go duration.
func parseAge(s string) (time.Duration, error) {
	d, ok := olderthan.Parse(s)
	if !ok {
		return 0, badRequest("older than %q is not an age like 30d, 12h or 90m", strings.TrimSpace(s))
	}
	return d, nil
}

func describe(f dlFilter) string {
	var parts []string
	if f.Topic != "" {
		parts = append(parts, fmt.Sprintf("topic %q", f.Topic))
	}
	if f.GroupMode == "is" {
		parts = append(parts, "group "+groupLabel(f.Group))
	}
	if f.Reason != "" {
		parts = append(parts, "reason "+f.Reason)
	}
	if f.After != "" {
		parts = append(parts, "failed at or after "+f.After+" UTC")
	}
	if f.Before != "" {
		parts = append(parts, "failed before "+f.Before+" UTC")
	}
	if len(parts) == 0 {
		return "no filter (every dead letter)"
	}
	return strings.Join(parts, ", ")
}

// stayedNote says why n dead letters a requeue selected are still dead
// letters: what RequeueDeadLetters leaves where it is.
// strandedNote says which groups of topics (nil: every topic) hold rows
// without a binding after a requeue: a dead letter goes back to the group
// that failed it, which may have been unbound or renamed since, and then
// no subscriber takes it. "" when none, or when Stats fails (a courtesy).
func (ui *UI) strandedNote(ctx context.Context, topics []string) string {
	// One read: of the topic, or of every topic, kept to those given (a
	// requeue by ids may span many).
	var opts []pgoutbox.StatsOption
	if len(topics) == 1 {
		opts = append(opts, pgoutbox.StatsForTopic(topics[0]))
	}
	all, err := pgoutbox.Stats(ctx, ui.exec, ui.tables, opts...)
	if err != nil {
		return ""
	}
	stats := all
	if topics != nil {
		stats = slices.DeleteFunc(all, func(s pgoutbox.QueueStats) bool { return !slices.Contains(topics, s.Topic) })
	}
	bound := map[string]bool{}
	for _, s := range stats {
		bound[s.Topic] = bound[s.Topic] || s.Bound
	}
	var stranded []string
	for _, s := range stats {
		if s.Unbound() > 0 && !waitsForFirstBinding(s.ConsumerGroup, bound[s.Topic]) {
			stranded = append(stranded, fmt.Sprintf("%s of %q", groupLabel(s.ConsumerGroup), s.Topic))
		}
	}
	if len(stranded) == 0 {
		return ""
	}
	return fmt.Sprintf(" Rows wait in groups not bound to their topic, which nobody consumes until bound again (or their rows moved with pgoutbox move): group %s.", strings.Join(stranded, "; group "))
}

func stayedNote(n int64) string {
	return plural(int(n), "dead letter") + " stayed: a message in the outbox holds the dedup key (its newer message, same group) or the id of each; requeue once that message is gone."
}

func plural(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return strconv.Itoa(n) + " " + what + "s"
}

// countedAtField carries the time a confirmation counted its rows, on the
// database clock, to the action it confirms.
const countedAtField = "counted_at"

// countedBefore bounds an action by failure time to what its confirmation
// counted: on the confirmation (!do) it reads the database clock and adds
// it to c's fields; on the action it reads it back from the form, or, from
// a form without it (an earlier build's), reads the clock. It returns the
// earlier of bound (zero: none) and that time.
func (ui *UI) countedBefore(ctx context.Context, do bool, f url.Values, c *confirmData, bound time.Time) (time.Time, error) {
	if v := f.Get(countedAtField); v != "" && do {
		at, err := time.Parse(time.RFC3339Nano, v)
		if err != nil {
			return bound, badRequest("%s %q is not a time; confirm again", countedAtField, v)
		}
		return dbclock.Before(bound, at), nil
	}
	at, err := dbclock.Now(ctx, ui.exec)
	if err != nil {
		return bound, err
	}
	if !do {
		c.Fields = append(c.Fields, kv{countedAtField, at.UTC().Format(time.RFC3339Nano)})
	}
	return dbclock.Before(bound, at), nil
}
