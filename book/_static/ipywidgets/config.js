// Where the Memory Goes: point RequireJS at the vendored widget bundle in this folder.
// embed-amd.js defines its modules by name (@jupyter-widgets/...); RequireJS derives each
// module's URL from its name, and the bundle loads its icon fonts relative to that URL.
// Mapping the names onto this folder makes those fonts load from the site, not from a CDN.
(function () {
  var src = document.currentScript.src;
  var here = src.slice(0, src.lastIndexOf("/") + 1);
  window.requirejs.config({
    paths: {
      "@jupyter-widgets/html-manager/dist": here.slice(0, -1),
      "@jupyter-widgets": here.slice(0, -1),
    },
  });
})();
