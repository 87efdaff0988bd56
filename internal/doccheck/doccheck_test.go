package doccheck

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// root is the repository's root, from this package's directory.
const root = "../.."

// unchecked are docs holding text moved verbatim from an earlier README,
// to be rewritten: their snippets are not excerpts yet. Their links are
// checked.
var unchecked = map[string]bool{
	"docs/consumer-groups.md": true,
	"docs/observability.md":   true,
}

var (
	markerRE  = regexp.MustCompile(`^<!-- snippet: (\S+) -->$`)
	linkRE    = regexp.MustCompile(`\]\(([^)#\s]*)(#[^)\s]*)?\)`)
	headingRE = regexp.MustCompile(`(?m)^#{1,6} (.+)$`)
	slugDrop  = regexp.MustCompile(`[^\p{L}\p{N} _-]`)
)

// anchors returns the heading anchors of a Markdown file, as GitHub makes
// them: lower case, punctuation dropped, spaces turned into hyphens.
func anchors(t *testing.T, doc string) map[string]bool {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(root, doc))
	require.NoError(t, err)
	out := map[string]bool{}
	inFence := false
	for _, line := range strings.Split(string(data), "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			inFence = !inFence
		}
		if m := headingRE.FindStringSubmatch(line); m != nil && !inFence {
			slug := slugDrop.ReplaceAllString(strings.ToLower(m[1]), "")
			out[strings.ReplaceAll(slug, " ", "-")] = true
		}
	}
	return out
}

func docs(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	require.NoError(t, err)
	out := []string{"README.md"}
	for _, f := range files {
		rel, err := filepath.Rel(root, f)
		require.NoError(t, err)
		out = append(out, filepath.ToSlash(rel))
	}
	return out
}

type snippet struct {
	doc    string
	line   int // of the opening fence
	source string
	lines  []string
}

// snippets returns the ```go blocks of a document with their markers; a
// block without a marker has source "".
func snippets(t *testing.T, doc string) []snippet {
	t.Helper()
	f, err := os.Open(filepath.Join(root, doc))
	require.NoError(t, err)
	defer f.Close()
	var out []snippet
	var cur *snippet
	prev := ""
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		switch {
		case cur != nil && strings.TrimSpace(line) == "```":
			out = append(out, *cur)
			cur = nil
		case cur != nil:
			cur.lines = append(cur.lines, line)
		case strings.TrimSpace(line) == "```go":
			cur = &snippet{doc: doc, line: n}
			if m := markerRE.FindStringSubmatch(strings.TrimSpace(prev)); m != nil {
				cur.source = m[1]
			}
		}
		if strings.TrimSpace(line) != "" {
			prev = line
		}
	}
	require.NoError(t, sc.Err())
	require.Nil(t, cur, "%s: a ```go block is not closed", doc)
	return out
}

// check returns "" when s is an excerpt of its source, else what is wrong.
func check(s snippet) string {
	if s.source == "" {
		return "no <!-- snippet: path --> marker on the line before the block"
	}
	data, err := os.ReadFile(filepath.Join(root, s.source))
	if err != nil {
		return fmt.Sprintf("source %s: %v", s.source, err)
	}
	var src []string
	for _, l := range strings.Split(string(data), "\n") {
		src = append(src, strings.TrimSpace(l))
	}
	at := 0
	for i, l := range s.lines {
		want := strings.TrimSpace(l)
		if want == "" || want == "// …" {
			continue
		}
		found := false
		for ; at < len(src); at++ {
			if src[at] == want {
				found, at = true, at+1
				break
			}
		}
		if !found {
			return fmt.Sprintf("line %d of the block, %q, is not in %s (after the lines before it)", i+1, want, s.source)
		}
	}
	return ""
}

func TestSnippetsAreExcerptsOfTestedCode(t *testing.T) {
	t.Parallel()
	total := 0
	for _, doc := range docs(t) {
		for _, s := range snippets(t, doc) {
			total++
			if unchecked[doc] {
				continue
			}
			if problem := check(s); problem != "" {
				t.Errorf("%s:%d: %s", s.doc, s.line, problem)
			}
		}
	}
	require.Greater(t, total, 10, "the docs have Go snippets")
}

// The checker itself: a changed line fails, an elision passes.
func TestCheckFindsStaleLines(t *testing.T) {
	t.Parallel()
	s := snippet{source: "internal/doccheck/doc.go", lines: []string{"// Package doccheck holds the test that keeps the documentation honest:", "// …", "package doccheck"}}
	require.Empty(t, check(s))
	s.lines = []string{"package doccheck", "// Package doccheck holds the test that keeps the documentation honest:"}
	require.Contains(t, check(s), "is not in", "out of order")
	s.lines = []string{"// Package doccheck holds the test that keeps the docs honest:"}
	require.Contains(t, check(s), "is not in")
	require.Contains(t, check(snippet{lines: []string{"x"}}), "no <!-- snippet")
}

// Relative links point at files that exist, and at headings they have.
func TestRelativeLinksResolve(t *testing.T) {
	t.Parallel()
	for _, doc := range docs(t) {
		data, err := os.ReadFile(filepath.Join(root, doc))
		require.NoError(t, err)
		for _, m := range linkRE.FindAllStringSubmatch(string(data), -1) {
			target, frag := m[1], strings.TrimPrefix(m[2], "#")
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			linked := doc
			if target != "" {
				path := filepath.Join(root, filepath.Dir(doc), target)
				_, err := os.Stat(path)
				require.NoError(t, err, "%s links to %s, which does not exist", doc, target)
				rel, err := filepath.Rel(root, path)
				require.NoError(t, err)
				linked = filepath.ToSlash(rel)
			}
			if frag != "" && strings.HasSuffix(linked, ".md") {
				if !anchors(t, linked)[frag] {
					t.Errorf("%s links to %s#%s: no such heading", doc, linked, frag)
				}
			}
		}
	}
}
