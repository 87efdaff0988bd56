package pgoutboxui

import (
	"fmt"
	"html/template"
	"strconv"
)

var pageNames = []string{"overview", "group", "deadletters", "deadletter", "confirm", "error"}

// parsePages parses each page with the layout and the shared parts.
func parsePages(basePath string) (map[string]*template.Template, error) {
	funcs := template.FuncMap{
		"num":   func(n int64) string { return thousands(n) },
		"int":   func(n int) string { return thousands(int64(n)) },
		"group": groupLabel,
		"age":   ageString,
		"asset": func(name string) string { return basePath + "assets/" + name },
	}
	pages := map[string]*template.Template{}
	for _, name := range pageNames {
		t, err := template.New(name).Funcs(funcs).ParseFS(files, "templates/layout.html", "templates/parts.html", "templates/"+name+".html")
		if err != nil {
			return nil, fmt.Errorf("pgoutboxui: parse templates: %w", err)
		}
		pages[name] = t
	}
	return pages, nil
}

// thousands formats n with thin spaces between groups of digits.
func thousands(n int64) string {
	s := strconv.FormatInt(n, 10)
	neg := n < 0
	if neg {
		s = s[1:]
	}
	out := ""
	for len(s) > 3 {
		out = "\u202f" + s[len(s)-3:] + out
		s = s[:len(s)-3]
	}
	out = s + out
	if neg {
		out = "-" + out
	}
	return out
}
